"""Platform plugins: the contract's types, the plugin manager, selection and the resolved facade."""

from octavo.platform.facade import Platform
from octavo.platform.manager import PLATFORM_GROUP, PLUGIN_GROUP, create_plugin_manager
from octavo.platform.selection import PLATFORM_ENV, choose_platform, detect_platforms
from octavo.platform.types import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    Capabilities,
    MemoryInfo,
    PlatformInfo,
    SamplingMetadata,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "Capabilities",
    "MemoryInfo",
    "PLATFORM_ENV",
    "PLATFORM_GROUP",
    "PLUGIN_GROUP",
    "Platform",
    "PlatformInfo",
    "SamplingMetadata",
    "choose_platform",
    "create_plugin_manager",
    "detect_platforms",
]
