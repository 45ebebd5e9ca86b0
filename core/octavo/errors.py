"""Errors the user can act on."""


class ConfigError(ValueError):
    """A configuration that cannot work, with the reason and what to change."""


class PlatformError(RuntimeError):
    """No usable platform, or a platform that cannot do what was asked."""


class KernelNotAvailableError(PlatformError):
    """A platform was asked for a kernel it does not (yet) provide."""


class RequestError(RuntimeError):
    """Something failed for these requests only (in the step, or while building their output).

    The engine fails ``request_ids`` with ``finish_reason="error"`` and keeps serving the rest; an
    error no request can be blamed for still stops the engine."""

    def __init__(self, request_ids, message: str) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
