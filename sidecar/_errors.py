"""The sidecar's exceptions: one base, each message naming the bad value and the fix."""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error the sidecar raises itself."""


class ConfigError(SidecarError):
    """A setting cannot work (bad value, unsafe bind address without a token)."""


class DecodeError(SidecarError):
    """An OTLP request body could not be decoded at all (answered with 400)."""


class StoreError(SidecarError):
    """The SQLite store could not be opened or written."""


class ApiError(SidecarError):
    """The sidecar API answered a CLI request with an error, or could not be reached."""

    def __init__(
        self, message: str, status: int | None = None, body: dict[str, object] | None = None
    ) -> None:
        super().__init__(message)
        #: The HTTP status the API answered, None when it was never reached.
        self.status = status
        #: The API's JSON error answer (``{"error": ...}`` and any details), if any.
        self.body = body
