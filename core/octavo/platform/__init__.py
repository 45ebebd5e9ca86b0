"""Platform plugins: the contract and the machinery that picks one platform and resolves it.

The contract a vendor implements is here in one place: the hooks (``hookspecs``, with the
``hookimpl`` marker) and the values they exchange (``types``). Kernels are checked against
``octavo.ops.reference`` by the conformance suite (``octavo.testing.conformance``). The rest is
the core's side: the plugin manager, platform selection and the resolved :class:`Platform`.
"""

from octavo.platform import hookspecs
from octavo.platform.facade import Platform
from octavo.platform.hookspecs import PROJECT_NAME, hookimpl, hookspec
from octavo.platform.manager import PLATFORM_GROUP, PLUGIN_GROUP, create_plugin_manager
from octavo.platform.selection import PLATFORM_ENV, choose_platform, detect_platforms
from octavo.platform.types import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    BitmaskFn,
    Capabilities,
    Communicator,
    EngineRunner,
    FusedMoEFn,
    FusedMoEPacker,
    LinearPacker,
    MemoryInfo,
    MLAAttentionBackend,
    MLASpec,
    MoESpec,
    PlatformInfo,
    QuantizedLinearPacker,
    RejectionSamplerFn,
    RMSNormFn,
    RotaryFn,
    SamplerFn,
    SamplingMetadata,
    ScaledMMFn,
    SiluAndMulFn,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "BitmaskFn",
    "Capabilities",
    "Communicator",
    "EngineRunner",
    "FusedMoEFn",
    "FusedMoEPacker",
    "MemoryInfo",
    "MLAAttentionBackend",
    "MLASpec",
    "MoESpec",
    "PLATFORM_ENV",
    "PLATFORM_GROUP",
    "PLUGIN_GROUP",
    "PROJECT_NAME",
    "Platform",
    "PlatformInfo",
    "RMSNormFn",
    "RejectionSamplerFn",
    "SamplerFn",
    "SamplingMetadata",
    "ScaledMMFn",
    "RotaryFn",
    "SiluAndMulFn",
    "LinearPacker",
    "QuantizedLinearPacker",
    "choose_platform",
    "create_plugin_manager",
    "detect_platforms",
    "hookimpl",
    "hookspec",
    "hookspecs",
]
