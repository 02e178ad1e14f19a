"""Plain records: step classes, compensations, retry policies, reports, escalation cards.

Every record is a frozen, slotted dataclass that round-trips through JSON, so a
process that never ran the forward steps (crash recovery) can rebuild it.
"""

from __future__ import annotations

import json
import math
import numbers
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from saga_otel._errors import ConfigurationError
from saga_otel._frozen import fast_init


class StepClass(StrEnum):
    """What a tool does to the world, which decides what the saga must remember."""

    READ = "read"  # no effect: nothing to undo
    CONVERGENT = "convergent"  # sets a desired state; retrying converges, nothing to undo
    REVERSIBLE = "reversible"  # undone by writing back the value read before the write
    COMPENSABLE = "compensable"  # undone by a separate operation (reverse_credit)
    IRREVERSIBLE = "irreversible"  # cannot be undone: crossing it is the pivot

    @classmethod
    def parse(cls, value: StepClass | str) -> StepClass:
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(c.value for c in cls)
            raise ConfigurationError(
                f"unknown step class {value!r}: use one of {allowed}"
            ) from None

    @property
    def pushes(self) -> bool:
        """Whether a successful do of this class leaves a compensation behind."""
        return self in (StepClass.REVERSIBLE, StepClass.COMPENSABLE)

    @property
    def writes(self) -> bool:
        return self is not StepClass.READ


def is_pivot(step_class: StepClass | str | None, declared_pivot: bool | None) -> bool:
    """The pivot rule, the one place it is written: a step is a pivot when it is
    declared one or its class is irreversible. Past the first successful pivot
    there is no unwind, only forward recovery and a person."""
    return bool(declared_pivot) or step_class == StepClass.IRREVERSIBLE


class RunStatus(StrEnum):
    COMPLETED = "completed"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    STUCK = "stuck"
    REJECTED = "rejected"


# json.dumps(sort_keys=True, allow_nan=False), prebuilt. No NaN or Infinity: RFC 8259
# JSON has neither, and the sidecar's sinks (PagerDuty, Alertmanager) refuse a body
# holding one, so an alert quoting such an argument would never be delivered.
_sorted_json = json.JSONEncoder(sort_keys=True, allow_nan=False).encode
_from_json = json.JSONDecoder().decode


def _not_json(o: object) -> Any:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


# The C encoder json.dumps(sort_keys=True) builds on every call, built once (no
# circular check: a cycle ends in RecursionError and takes the full encoder's path).
_make_c_encoder = getattr(json.encoder, "c_make_encoder", None)
_c_encoder = (
    _make_c_encoder(
        None, _not_json, json.encoder.encode_basestring_ascii, None, ": ", ", ", True, False, False
    )
    if _make_c_encoder is not None
    else None
)


_PLAIN = frozenset({str, int, bool, type(None)})


def _json_text(plain: dict[str, Any]) -> str:
    """``plain`` as JSON with sorted keys (how a Compensation stores its arguments).
    One frame around the prebuilt C encoder: this runs once per pushed undo."""
    try:
        if _c_encoder is not None:
            try:
                return "".join(_c_encoder(plain, 0))
            except RecursionError:
                pass  # a cycle: the full encoder's check names it
        return _sorted_json(plain)
    except TypeError:  # keys of mixed types cannot be sorted before JSON makes them strings
        return _sorted_json(_from_json(json.dumps(plain, allow_nan=False)))


def args_json(value: Mapping[str, Any]) -> str | None:
    """``value`` as :meth:`Compensation.args_json` would store it (JSON with sorted keys),
    or None when it is not plain JSON: the one normal form to compare arguments in."""
    try:
        return _json_text(dict(value))
    except Exception:  # not plain JSON, whatever the value raised on the way (a user Mapping)
        return None


def _json_object_and_text(value: Mapping[str, Any], what: str) -> tuple[dict[str, Any], str]:
    """A deep copy of ``value`` through JSON, and its JSON text with sorted keys (one encode).

    Flat arguments of strings, ints, bools and None (the usual ids) come back
    from JSON unchanged, so their copy skips the decode. ``what`` names the value
    in the error (``arguments of <what>``).
    """
    try:
        plain = dict(value)
        text = _json_text(plain)
        for k, v in plain.items():
            if type(k) is not str or type(v) not in _PLAIN:
                return dict(_from_json(text)), text
        return plain, text
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"arguments of {what} must be JSON-serialisable (plain str/int/float/bool/None, "
            f"lists and dicts; no NaN or Infinity), got {value!r} ({exc}): return plain "
            "references such as ids from the tool"
        ) from exc


@dataclass(frozen=True, slots=True, init=False)
class Compensation:
    """The operation that undoes one successful write, with the references it returned.

    ``tool`` is resolved by name through a :class:`ToolRegistry` at unwind time,
    so the record can cross a process boundary. ``step`` and ``index`` name the
    forward step it undoes.
    """

    tool: str
    args: Mapping[str, Any]
    description: str = ""
    step: str = ""
    index: int = -1
    _args_json: str = field(default="", init=False, repr=False, compare=False)

    def __init__(
        self,
        tool: str,
        args: Mapping[str, Any],
        description: str = "",
        step: str = "",
        index: int = -1,
    ) -> None:
        # Written out (not the dataclass's __init__ and a __post_init__): every field is
        # set once, the arguments already frozen.
        if not tool or not isinstance(tool, str):
            raise ConfigurationError(
                f"a compensation needs a tool name, got {tool!r}: name the registered "
                "tool that undoes the step"
            )
        # Freeze the arguments now: a later mutation by the caller must not change the undo.
        frozen, text = _json_object_and_text(args, tool)
        # Through each slot's descriptor (the frozen guard's way around, as
        # saga_otel._frozen's inits): object.__setattr__ looks the slot up by name.
        _set_tool(self, tool)
        _set_args(self, frozen)
        _set_description(self, description)
        _set_step(self, step)
        _set_index(self, index)
        _set_args_json(self, text)

    def args_json(self) -> str:
        """The arguments as JSON with sorted keys (the span attribute), encoded once."""
        return self._args_json

    def fresh_args(self) -> dict[str, Any]:
        """A new copy of the arguments as stored, for one call of the undo: what the undo
        does to them changes neither its next attempt nor this record. Decoded from the
        stored JSON rather than deep-copied: C code with no memo walk, so cheaper, and
        exactly what a recovery elsewhere runs from the sidecar's copy."""
        args: dict[str, Any] = _from_json(self._args_json)
        return args

    def to_dict(self) -> dict[str, Any]:
        """The record as stored: its arguments decoded from :meth:`args_json`, so a live
        ``args`` someone mutated (through ``run.stack``) never reaches a span, report or card."""
        return {
            "step": self.step,
            "index": self.index,
            "tool": self.tool,
            "args": self.fresh_args(),
            "description": self.description,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Compensation:
        try:
            return cls(
                tool=str(data["tool"]),
                args=dict(data.get("args") or {}),
                description=str(data.get("description", "")),
                step=str(data.get("step", "")),
                index=int(data.get("index", -1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"not a compensation record: {data!r}; expected an object with "
                '"tool", "args", "description", "step" and "index"'
            ) from exc

    @classmethod
    def from_json(cls, text: str) -> Compensation:
        return cls.from_dict(json.loads(text))


_set_tool, _set_args, _set_description, _set_step, _set_index, _set_args_json = (
    getattr(Compensation, name).__set__
    for name in ("tool", "args", "description", "step", "index", "_args_json")
)


def backoff_seconds(
    failures: int,
    *,
    initial: float,
    maximum: float,
    multiplier: float = 2.0,
    jitter: float = 0.0,
    jitter_ratio: float = 0.0,
    rng: random.Random | None = None,
) -> float:
    """The one backoff formula of both packages: seconds to wait after ``failures`` (from 1).

    Exponential from ``initial`` by ``multiplier``, capped at ``maximum``, plus a
    random spread of up to ``jitter`` seconds and up to ``jitter_ratio`` times the
    capped delay, so many clients that lost the same peer do not retry in step.
    Used by `RetryPolicy`, the export sender and the sidecar's alert outbox.
    """
    # The exponent is capped so a long outage cannot overflow a float; a multiplier so
    # large that its power overflows anyway is past any cap.
    try:
        grown = initial * multiplier ** min(max(failures - 1, 0), 64)
    except OverflowError:
        grown = math.inf if initial > 0 else 0.0
    base = min(maximum, grown)
    spread = jitter + base * jitter_ratio
    return base + ((rng or random).uniform(0.0, spread) if spread > 0 else 0.0)


#: The longest ``initial``, ``maximum`` or ``jitter`` of a :class:`RetryPolicy`, in seconds:
#: a day. Every sleep accepts it; a longer wait is a schedule, not a retry.
MAX_RETRY_DELAY = 86_400.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often, and how far apart, an activity is tried.

    Delays grow exponentially from ``initial`` by ``multiplier`` up to ``maximum``,
    with up to ``jitter`` seconds of random spread so many retrying runs do not
    hit a recovering backend in step. ``initial``, ``maximum`` and ``jitter`` are
    finite seconds from 0 to :data:`MAX_RETRY_DELAY` (a day), so no wait is longer
    than ``maximum + jitter``; ``multiplier`` is finite and at least 1.
    """

    attempts: int = 3
    initial: float = 0.1
    multiplier: float = 2.0
    maximum: float = 5.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, numbers.Integral):
            raise ConfigurationError(
                f"RetryPolicy(attempts={self.attempts!r}) is not a whole number of tries: use "
                "an int >= 1, e.g. attempts=3"
            )
        if self.attempts < 1:
            raise ConfigurationError(
                f"RetryPolicy(attempts={self.attempts}) never runs the activity: use attempts >= 1"
            )
        for name in ("initial", "maximum", "jitter"):
            value = getattr(self, name)
            if not _real_in(value, 0.0, MAX_RETRY_DELAY):
                raise ConfigurationError(
                    f"RetryPolicy({name}={value!r}) is not a delay a sleep can wait: use a "
                    f"finite number of seconds from 0 to {MAX_RETRY_DELAY:g} (a day)"
                )
        if not _real_in(self.multiplier, 1.0, sys.float_info.max):
            raise ConfigurationError(
                f"RetryPolicy(multiplier={self.multiplier!r}) is not a growth factor for "
                "the delays: use a finite number >= 1, e.g. multiplier=2.0"
            )

    def delay(self, failed_attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after attempt number ``failed_attempt`` (from 1) failed."""
        return backoff_seconds(
            failed_attempt,
            initial=self.initial,
            multiplier=self.multiplier,
            maximum=self.maximum,
            jitter=self.jitter,
            rng=rng,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "initial": self.initial,
            "multiplier": self.multiplier,
            "maximum": self.maximum,
            "jitter": self.jitter,
        }


def _real_in(value: object, low: float, high: float) -> bool:
    """Whether ``value`` is a real number (not a bool) in [low, high]; never NaN."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and low <= float(value) <= high  # False for NaN
    )


@fast_init
@dataclass(frozen=True, slots=True)
class StepRecord:
    """One forward step as it ended."""

    index: int
    name: str
    tool: str
    step_class: StepClass
    attempts: int
    ok: bool
    pivot: bool = False
    compensation: Compensation | None = None
    error: str | None = None
    # Set when the do succeeded but its undo could not be stored (see max_undo_bytes):
    # an effect that stands with nothing on the stack to reverse it.
    undo_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "tool": self.tool,
            "class": self.step_class.value,
            "attempts": self.attempts,
            "ok": self.ok,
            "pivot": self.pivot,
            "compensation": self.compensation.to_dict() if self.compensation else None,
            "error": self.error,
            "undo_error": self.undo_error,
        }


@fast_init
@dataclass(frozen=True, slots=True)
class CompensationOutcome:
    """One compensation as the unwind left it."""

    compensation: Compensation
    ok: bool
    attempts: int
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "compensation": self.compensation.to_dict(),
            "ok": self.ok,
            "attempts": self.attempts,
            "error": self.error,
        }


#: What an exception reads as when its ``str()`` fails: the traceback module's own placeholder.
UNPRINTABLE = "<exception str() failed>"


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, total: the one rule for an exception's text in this library.

    An exception whose ``__str__`` raises (or returns no string) reads as
    :data:`UNPRINTABLE`, so reporting it never replaces it or breaks the run.
    """
    try:
        return str(exc)
    except BaseException:  # as traceback's _safe_string: whatever a broken __str__ raises
        return UNPRINTABLE


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exception_text(exc)}"


def interrupted_effect(
    step: str,
    index: int,
    step_class: StepClass,
    pivot: bool | None,
    exc: BaseException | None,
    *,
    moment: Literal["before", "returned", "running", "late"] = "before",
) -> str | None:
    """Why the effect of a do is unknown, or stands with no undo; None when it is not so.

    A tool's own exception says its write did not happen (the convention the retries
    rest on). An interrupt (a cancellation, Ctrl-C, SystemExit) stops the agent's wait,
    not the write: a request already sent, a framework's worker thread still running.
    A write that leaves an undo, or a pivot, stopped so may stand with no undo stored,
    so its run must not end compensated. ``moment`` says when ``exc`` stopped it:
    ``before`` the do returned; once it had ``returned``, in the capture of its undo
    (its effect stands); while it was still ``running`` and its run stopped waiting
    for it (``exc`` None: the wait's bound passed); or it returned ``late``, after
    that (``exc`` None; its effect stands and its undo is never pushed).
    """
    if isinstance(exc, Exception) or not (step_class.pushes or is_pivot(step_class, pivot)):
        return None
    head = f"the do of step {step!r} (index {index})"
    by = type(exc).__name__
    if moment == "late":
        return (
            f"{head} returned after its run had stopped waiting for it: it took effect, and "
            "its undo was never pushed nor run. Undo it by hand, or accept it"
        )
    if moment == "returned":
        return (
            f"{head} returned, but {by} stopped the capture of its undo: it took effect, and "
            "no undo was stored. Undo it by hand, or accept it"
        )
    if moment == "running":
        why = "its settle_timeout passed" if exc is None else f"on {by}"
        return (
            f"{head} was still running when its run stopped waiting for it ({why}): it may "
            "take effect, and no undo was stored. Check the effect and undo it by hand if "
            "it happened"
        )
    return (
        f"{head} was interrupted by {by} before it returned: it may have taken effect, and "
        "no undo was stored. Check the effect and undo it by hand if it happened"
    )


def _card_text(value: object) -> str:
    """A card's text from any value: a string as it is, null as "", else its JSON text."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    for sort_keys in (True, False):  # keys of mixed types cannot be sorted
        try:
            return json.dumps(value, sort_keys=sort_keys, ensure_ascii=False, default=repr)
        except Exception:  # not JSON at all: a cycle, a repr that raises
            continue
    return f"<{type(value).__name__} that is not JSON>"


def _card_opt_text(value: object) -> str | None:
    return None if value is None else _card_text(value)


def _card_lines(value: object) -> tuple[str, ...]:
    """A card's list field from any value: a list's items, null none, else one line."""
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple("null" if item is None else _card_text(item) for item in value)
    return (_card_text(value),)


@dataclass(frozen=True, slots=True)
class EscalationCard:
    """What a person needs to act on a run the machine could not finish.

    Structured for tools, and :meth:`render` for a person at 3 a.m.
    """

    saga: str
    run_id: str
    reason: str
    failed_step: str | None
    error: str | None
    done: tuple[str, ...]
    undone: tuple[str, ...]
    not_undone: tuple[str, ...]
    irreversible: tuple[str, ...]
    decide: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "saga": self.saga,
            "run_id": self.run_id,
            "reason": self.reason,
            "failed_step": self.failed_step,
            "error": self.error,
            "done": list(self.done),
            "undone": list(self.undone),
            "not_undone": list(self.not_undone),
            "irreversible": list(self.irreversible),
            "decide": list(self.decide),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: object) -> EscalationCard:
        """The card in ``data``, total over any JSON value: cards come from agents in any
        language (Go writes an empty list as ``null``), and reading one must never cost
        the run its alert or its page.

        A list field takes a list as its lines, null or absence as none, any other value
        as one line; a line or a text field takes a string as it is and any other value
        as its JSON text (``5``, ``{"a": 1}``); null is "" for the text fields and None
        for ``failed_step`` and ``error``. A ``data`` that is not an object holds no field.
        """
        card: Mapping[Any, Any] = data if isinstance(data, Mapping) else {}
        return cls(
            saga=_card_text(card.get("saga")),
            run_id=_card_text(card.get("run_id")),
            reason=_card_text(card.get("reason")),
            failed_step=_card_opt_text(card.get("failed_step")),
            error=_card_opt_text(card.get("error")),
            done=_card_lines(card.get("done")),
            undone=_card_lines(card.get("undone")),
            not_undone=_card_lines(card.get("not_undone")),
            irreversible=_card_lines(card.get("irreversible")),
            decide=_card_lines(card.get("decide")),
        )

    def render(self) -> str:
        def section(title: str, items: tuple[str, ...]) -> list[str]:
            return [f"{title}:"] + ([f"  - {i}" for i in items] or ["  (nothing)"])

        head = f"saga {self.saga} run {self.run_id} needs a person: {self.reason}"
        lines = [head, "=" * len(head)]
        if self.failed_step:
            lines.append(f"Failed at step {self.failed_step}: {self.error}")
        lines += section("Done", self.done)
        lines += section("Undone", self.undone)
        lines += section("Could NOT be undone", self.not_undone + self.irreversible)
        lines += section("You must decide", self.decide)
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A forward call a stuck run still owes: retried by forward recovery."""

    index: int
    name: str
    tool: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "tool": self.tool, "args": dict(self.args)}


@fast_init
@dataclass(frozen=True, slots=True)
class SagaReport:
    """How a run ended. ``error`` is the original exception, unchanged."""

    saga: str
    run_id: str
    status: RunStatus
    steps: tuple[StepRecord, ...]
    failed_step: str | None = None
    error: BaseException | None = None
    compensations: tuple[CompensationOutcome, ...] = ()
    pending: tuple[PendingCall, ...] = ()
    trace_id: int = 0
    span_id: int = 0

    @property
    def compensations_run(self) -> tuple[Compensation, ...]:
        return tuple(o.compensation for o in self.compensations if o.ok)

    @property
    def compensations_failed(self) -> tuple[CompensationOutcome, ...]:
        return tuple(o for o in self.compensations if not o.ok)

    @property
    def irreversible_steps(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.steps if s.ok and is_pivot(s.step_class, s.pivot))

    @property
    def pivot_step(self) -> str | None:
        irreversible = self.irreversible_steps
        return irreversible[0] if irreversible else None

    @property
    def unstorable_undos(self) -> tuple[StepRecord, ...]:
        """Steps whose effect stands, or may, with no stored undo (it could not be
        captured, or the do was interrupted before it returned)."""
        return tuple(s for s in self.steps if s.undo_error is not None)

    @property
    def needs_person(self) -> bool:
        return self.status in (RunStatus.COMPENSATION_FAILED, RunStatus.STUCK)

    @property
    def error_text(self) -> str | None:
        return describe_error(self.error) if self.error is not None else None

    def escalation_card(self) -> EscalationCard | None:
        if not self.needs_person:
            return None
        undone = tuple(
            o.compensation.description or f"{o.compensation.tool}({o.compensation.step})"
            for o in self.compensations
            if o.ok
        )
        not_undone = tuple(
            f"{o.compensation.description or o.compensation.tool}: {o.error} "
            # The arguments as stored (what recovery runs), never the live record's.
            f"(tool {o.compensation.tool}, args {o.compensation.args_json()})"
            for o in self.compensations
            if not o.ok
        ) + tuple(f"{s.name} (tool {s.tool}): {s.undo_error}" for s in self.unstorable_undos)
        done = tuple(f"{s.name} ({s.step_class.value})" for s in self.steps if s.ok)
        decide: tuple[str, ...]
        if self.status is RunStatus.STUCK:
            decide = (
                f"Finish forward: retry {self.failed_step} and what follows (idempotent), "
                "or settle by hand and resolve the run",
                f"Nothing was undone, because the run had crossed its pivot ({self.pivot_step}).",
            )
        else:
            decide = tuple(
                f"Undo by hand or accept: {o.compensation.description or o.compensation.tool}"
                for o in self.compensations
                if not o.ok
            ) + tuple(
                f"Undo by hand or accept: {s.name} (tool {s.tool}), whose undo was never stored"
                for s in self.unstorable_undos
            )
        return EscalationCard(
            saga=self.saga,
            run_id=self.run_id,
            reason=self.status.value,
            failed_step=self.failed_step,
            error=self.error_text,
            done=done,
            undone=undone,
            not_undone=not_undone,
            irreversible=self.irreversible_steps,
            decide=decide,
        )

    def to_dict(self) -> dict[str, Any]:
        card = self.escalation_card()
        return {
            "saga": self.saga,
            "run_id": self.run_id,
            "status": self.status.value,
            "steps": [s.to_dict() for s in self.steps],
            "failed_step": self.failed_step,
            "error": self.error_text,
            "compensations": [o.to_dict() for o in self.compensations],
            "pending": [p.to_dict() for p in self.pending],
            "escalation": card.to_dict() if card else None,
        }
