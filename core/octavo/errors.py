"""Errors the user can act on."""


class ConfigError(ValueError):
    """A configuration that cannot work, with the reason and what to change."""


class PlatformError(RuntimeError):
    """No usable platform, or a platform that cannot do what was asked."""


class KernelNotAvailableError(PlatformError):
    """A platform was asked for a kernel it does not (yet) provide."""
