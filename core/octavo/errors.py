"""Errors the user can act on."""


class ConfigError(ValueError):
    """A configuration that cannot work, with the reason and what to change."""


class PlatformError(RuntimeError):
    """No usable platform, or a platform that cannot do what was asked."""


class KernelNotAvailableError(PlatformError):
    """A platform was asked for a kernel it does not (yet) provide."""


class RequestError(RuntimeError):
    """Something failed for these requests only (in the step, or while building their output).

    ``messages`` maps each request id to what failed for it (a request is told only its own).
    The engine fails those requests with ``finish_reason="error"`` and keeps serving the rest;
    an error no request can be blamed for still stops the engine."""

    def __init__(self, messages: dict[str, str]) -> None:
        super().__init__(
            "; ".join(f"{request_id}: {message}" for request_id, message in messages.items())
        )
        self.messages = dict(messages)

    def __reduce__(self):  # it crosses from a tensor-parallel worker to the engine
        return (type(self), (self.messages,))

    @property
    def request_ids(self) -> list[str]:
        return list(self.messages)
