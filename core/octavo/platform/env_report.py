"""``octavo env``: every plugin found, what each detected and why, and the platform chosen."""

from __future__ import annotations

import os
from typing import Optional

import torch

import octavo
from octavo.errors import PlatformError
from octavo.platform.manager import create_plugin_manager, plugin_records
from octavo.platform.selection import choose_platform, detect_platforms


def render_env_report(device: Optional[str] = None, pm=None) -> str:
    """The report as text. Selection errors are reported, not raised: the report is for
    diagnosing exactly those."""
    pm = pm if pm is not None else create_plugin_manager()
    records = plugin_records(pm)
    detections = detect_platforms(pm)
    lines = [
        f"octavo {octavo.__version__}, torch {torch.__version__}",
        f"host threads: torch {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: OpenMP spins)')}",
        "",
        "platforms:",
    ]
    for d in sorted(detections, key=lambda d: -d.info.priority):
        rec = records.get(d.plugin_name)
        dist = f"{rec.dist_name} {rec.dist_version}" if rec and rec.dist_name else "(in-process)"
        state = "available" if d.info.available else "unavailable"
        lines.append(
            f"  {d.info.name:<10} {state:<12} priority {d.info.priority:<4} {dist:<32} "
            f"{d.info.reason}"
        )
    platform_plugins = {d.plugin_name for d in detections}
    others = [r for name, r in sorted(records.items()) if name not in platform_plugins]
    others = [r for r in others if r.dist_name is not None]
    if others:
        lines += ["", "other plugins:"]
        lines += [f"  {r.name:<24} {r.dist_name} {r.dist_version}" for r in others]
    lines.append("")
    try:
        selection = choose_platform(detections, device)
        lines.append(f"chosen: {selection.chosen.info.name} ({selection.why})")
    except PlatformError as exc:
        lines.append(f"chosen: none: {exc}")
    return "\n".join(lines)
