"""The plugin manager: octavo's hookspecs plus every plugin installed through entry points."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import pluggy

from octavo import hookspecs

PLATFORM_GROUP = "octavo.platforms"
"""Entry-point group of platform plugins (built-in and vendor)."""

PLUGIN_GROUP = "octavo.plugins"
"""Entry-point group of other extension plugins: model architectures, KV connectors, kernel packs."""


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
    misspelled hook fails loudly at start-up instead of being silently ignored.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        pm.load_setuptools_entrypoints(PLATFORM_GROUP)
        pm.load_setuptools_entrypoints(PLUGIN_GROUP)
    for name, plugin in plugins:
        pm.register(plugin, name=name)
    pm.check_pending()
    return pm


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
