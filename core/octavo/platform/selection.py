"""Choosing one platform at start-up: detection, the override, priorities, unregistering losers."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import pluggy

from octavo.errors import PlatformError
from octavo.platform.types import PlatformInfo

PLATFORM_ENV = "OCTAVO_PLATFORM"


@dataclasses.dataclass(frozen=True)
class Detection:
    """What one platform plugin reported (or the error it raised while detecting)."""

    plugin_name: str
    info: PlatformInfo


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen platform, why, and everything that was detected."""

    chosen: Detection
    why: str
    detections: tuple[Detection, ...]


def detect_platforms(pm: pluggy.PluginManager) -> list[Detection]:
    """Ask every plugin's ``octavo_platform_detect`` and keep who answered what.

    A plugin whose detection raises is reported unavailable with the error as its reason, so one
    broken vendor package never stops octavo from starting on another platform.
    """
    detections = []
    for impl in pm.hook.octavo_platform_detect.get_hookimpls():
        name = pm.get_name(impl.plugin) or impl.plugin_name
        try:
            info = impl.function()
        except Exception as exc:  # a broken plugin must not take the others down
            info = PlatformInfo(name, "unknown", False, -1, f"detection failed: {exc!r}")
        if info is not None:
            detections.append(Detection(name, info))
    return detections


def choose_platform(detections: list[Detection], requested: Optional[str] = None) -> Selection:
    """Apply the selection rules.

    ``requested`` (``--device``) or else ``$OCTAVO_PLATFORM`` names a platform to use or fail
    with its reason; otherwise the available platform with the highest priority wins, and a tie
    between two is an error naming both.
    """
    requested = requested or os.environ.get(PLATFORM_ENV) or None
    frozen = tuple(detections)
    if requested:
        by_name = {d.info.name: d for d in detections}
        if requested not in by_name:
            known = ", ".join(sorted(by_name)) or "none"
            raise PlatformError(
                f"platform {requested!r} was requested but no installed plugin provides it "
                f"(installed: {known}); install its package, e.g. `pip install octavo[{requested}]`"
            )
        chosen = by_name[requested]
        if not chosen.info.available:
            raise PlatformError(
                f"platform {requested!r} was requested but is not available: {chosen.info.reason}"
            )
        source = "--device" if requested != os.environ.get(PLATFORM_ENV) else PLATFORM_ENV
        return Selection(chosen, f"requested by {source}", frozen)
    available = [d for d in detections if d.info.available]
    if not available:
        found = "; ".join(f"{d.info.name}: {d.info.reason}" for d in detections) or "none"
        raise PlatformError(
            f"no platform is available (detected: {found}); install octavo-cpu "
            "(`pip install octavo[cpu]`), which works on every machine"
        )
    best = max(d.info.priority for d in available)
    top = [d for d in available if d.info.priority == best]
    if len(top) > 1:
        names = " and ".join(repr(d.info.name) for d in top)
        raise PlatformError(
            f"platforms {names} are both available with priority {best}; choose one with "
            f"--device or {PLATFORM_ENV}"
        )
    return Selection(top[0], f"highest priority ({best}) among available platforms", frozen)


def unregister_losers(pm: pluggy.PluginManager, selection: Selection) -> None:
    """Remove every platform plugin except the chosen one, before any kernel hook runs."""
    for detection in selection.detections:
        if detection.plugin_name != selection.chosen.plugin_name:
            plugin = pm.get_plugin(detection.plugin_name)
            if plugin is not None:
                pm.unregister(plugin)
