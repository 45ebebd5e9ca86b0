"""The plugin manager: octavo's hookspecs plus every plugin installed through entry points."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from typing import Iterable, Optional

import pluggy

from octavo.platform import hookspecs
from octavo.platform.types import PlatformInfo

logger = logging.getLogger(__name__)

PLATFORM_GROUP = "octavo.platforms"
"""Entry-point group of platform plugins (built-in and vendor)."""

PLUGIN_GROUP = "octavo.plugins"
"""Entry-point group of other extension plugins: model architectures, KV connectors, kernel
packs."""


@dataclasses.dataclass(frozen=True)
class PluginRecord:
    """One registered plugin and the distribution that installed it (None for in-process ones)."""

    name: str
    dist_name: Optional[str]
    dist_version: Optional[str]


def create_plugin_manager(
    *, load_entry_points: bool = True, plugins: Iterable[tuple[str, object]] = ()
) -> pluggy.PluginManager:
    """Build a plugin manager with the octavo hookspecs and the installed plugins.

    ``plugins`` registers extra ``(name, module_or_object)`` pairs, as tests and embedders do.
    Unknown ``octavo_*`` hook names in any plugin are rejected here (``check_pending``), so a
    misspelled hook fails loudly at start-up instead of being silently ignored. A plugin that
    fails to import does not take the others down (see ``load_entry_points_of``).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        load_entry_points_of(pm, PLATFORM_GROUP)
        load_entry_points_of(pm, PLUGIN_GROUP)
    for name, plugin in plugins:
        pm.register(plugin, name=name)
    pm.check_pending()
    return pm


def load_entry_points_of(pm: pluggy.PluginManager, group: str) -> None:
    """Register the plugins of one entry-point group, one at a time.

    A platform plugin that fails to import (a broken vendor package, a missing runtime library)
    is replaced by a stand-in that reports the platform unavailable with the import error as its
    reason: octavo still starts on another platform, and ``--device NAME`` or ``octavo env`` says
    what went wrong. Any other plugin that fails to import is logged and skipped.

    The group is first loaded whole (pluggy scans every installed distribution once per call);
    only when a plugin fails is it loaded again one entry point at a time.
    """
    try:
        pm.load_setuptools_entrypoints(group)
        return
    except Exception:  # noqa: BLE001 - some plugin failed: find which, one at a time below
        pass
    for entry_point in importlib.metadata.entry_points(group=group):
        if pm.get_plugin(entry_point.name) is not None or pm.is_blocked(entry_point.name):
            continue
        try:
            pm.load_setuptools_entrypoints(group, name=entry_point.name)
        except Exception as exc:  # the plugin's own code failed; the others must still load
            message = f"plugin {entry_point.name!r} ({entry_point.value}) failed to import: {exc!r}"
            if group != PLATFORM_GROUP:
                logger.error("%s; octavo runs without it", message)
                continue
            pm.register(UnimportablePlatform(entry_point.name, message), name=entry_point.name)


class UnimportablePlatform:
    """Stands in for a platform plugin whose module failed to import."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    @hookspecs.hookimpl
    def octavo_platform_detect(self) -> PlatformInfo:
        return PlatformInfo(
            self.name, "unknown", False, -1, f"{self.reason}; reinstall or fix that package"
        )


def plugin_records(pm: pluggy.PluginManager) -> dict[str, PluginRecord]:
    """Name -> record for every registered plugin, with its distribution where known."""
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    records = {}
    for name, plugin in pm.list_name_plugin():
        dist = dists.get(id(plugin))
        records[name] = PluginRecord(
            name=name,
            dist_name=dist.metadata["name"] if dist is not None else None,
            dist_version=dist.version if dist is not None else None,
        )
    return records
