"""The package's exceptions: one base, each message naming the bad value and the fix."""

from __future__ import annotations


class SagaError(Exception):
    """Base of every error raised by saga_otel itself (never of a tool's own errors)."""


class ConfigurationError(SagaError):
    """A saga, tool or exporter was set up with a value that cannot work."""


class UnknownToolError(SagaError, LookupError):
    """A tool name is not in the registry the saga or recovery was given."""


class StepRefusedError(SagaError):
    """A call was refused before any side effect, because it would break a pivot rule."""


class ValidationRejectedError(SagaError):
    """A pre-flight validation rejected the run before its first do."""


class RecoveryError(SagaError):
    """A run's stack could not be fetched or unwound from another process."""
