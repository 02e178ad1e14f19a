"""The saga span contract as code: the one validator of a span's saga attributes.

:func:`check` is what the sidecar runs on every span that carries ``saga.phase``
at intake (a span with problems is rejected, partial success) and what
:func:`saga_otel.testing.contract_violations` runs with ``complete=True`` on the
spans a test captured. Both read the same rules, so an emitter that passes its
tests is accepted by the sidecar. The rules are docs/semantic-conventions.md.

Two levels:

* the **intake** rules (always): what a reader needs to fold a span correctly:
  a known phase, attribute types, a valid run id
  (:func:`saga_otel.semconv.run_id_problem`), step index and attempt, a known
  step class *when one is given*, a known run status, JSON where JSON is promised.
* ``complete=True`` adds what every span saga-otel emits carries besides:
  ``saga.contract.version``, ``saga.name``, each phase's attributes, the span
  name, and ``saga.stack`` as JSON.

A missing ``saga.step.class`` is not a problem at either level: emitters in
other languages may not classify their tools, and the class only refines the
pivot rule (:func:`saga_otel.records.is_pivot`); an unclassified step is a pivot
only when ``saga.step.pivot`` says so. A class that *is* given must be one of
:data:`saga_otel.semconv.STEP_CLASSES`.
"""

from __future__ import annotations

import json
import json.scanner
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, TypeGuard

from saga_otel import semconv as sc

__all__ = ["MISSING", "Problem", "check"]


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Final = _Missing()
"""The ``value`` of a :class:`Problem` about an attribute the span does not carry."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One way a span breaks the contract: the attribute, its bad value, and the fix."""

    attribute: str
    value: object
    fix: str

    def __str__(self) -> str:
        return f"{self.attribute}={self.value!r}: {self.fix}"


_STR_ATTRS = (
    sc.SAGA_RUN_ID,
    sc.SAGA_NAME,
    sc.SAGA_RUN_STATUS,
    sc.SAGA_RUN_FAILED_STEP,
    sc.SAGA_STEP_NAME,
    sc.SAGA_STEP_CLASS,
    sc.SAGA_COMPENSATION_TOOL,
    sc.SAGA_COMPENSATION_ARGS,
    sc.SAGA_COMPENSATION_DESCRIPTION,
    sc.SAGA_UNWIND_REASON,
    sc.SAGA_STACK,
    sc.SAGA_ESCALATION_REASON,
    sc.SAGA_ESCALATION_CARD,
    sc.SAGA_COMPENSATION_UNSTORABLE,
    sc.SAGA_EXPORT_DROPPED,
    sc.SAGA_EXPORT_DROPPED_SPAN,
)
_INT_ATTRS = (
    sc.SAGA_CONTRACT_VERSION,
    sc.SAGA_STEP_INDEX,
    sc.SAGA_STEP_ATTEMPT,
    sc.SAGA_RECOVERY_TOKEN,
    sc.SAGA_HEARTBEAT_BEAT,
    sc.SAGA_HEARTBEAT_PARTS,
)
_KINDS: dict[str, type] = {
    **dict.fromkeys(_STR_ATTRS, str),
    **dict.fromkeys(_INT_ATTRS, int),
    sc.SAGA_STEP_PIVOT: bool,
}
_KIND_NAMES = {str: "a string", int: "an int", bool: "a bool"}

# complete=True: what each phase's spans carry besides the intake minimum.
_PHASE_ATTRS: Final[Mapping[str, tuple[str, ...]]] = {
    sc.PHASE_RUN: (sc.SAGA_RUN_STATUS,),
    sc.PHASE_VALIDATE: (sc.SAGA_STEP_NAME,),
    sc.PHASE_DO: (sc.SAGA_STEP_NAME, sc.SAGA_STEP_INDEX, sc.SAGA_STEP_ATTEMPT, sc.SAGA_STEP_PIVOT),
    sc.PHASE_UNWIND: (sc.SAGA_UNWIND_REASON, sc.SAGA_RUN_FAILED_STEP, sc.SAGA_STACK),
    sc.PHASE_COMPENSATE: (
        sc.SAGA_STEP_NAME,
        sc.SAGA_STEP_INDEX,
        sc.SAGA_STEP_ATTEMPT,
        sc.SAGA_COMPENSATION_TOOL,
        sc.SAGA_COMPENSATION_ARGS,
    ),
    sc.PHASE_ESCALATE: (sc.SAGA_ESCALATION_REASON, sc.SAGA_ESCALATION_CARD),
    sc.PHASE_HEARTBEAT: (sc.SAGA_HEARTBEAT_OPEN_RUNS, sc.SAGA_HEARTBEAT_INTERVAL_S),
}
# complete=True: the span name, from the attribute it is built of.
_NAMES: Final[Mapping[str, tuple[str, Callable[[str], str]]]] = {
    sc.PHASE_RUN: (sc.SAGA_NAME, sc.run_span_name),
    sc.PHASE_VALIDATE: (sc.SAGA_STEP_NAME, sc.validate_span_name),
    sc.PHASE_DO: (sc.SAGA_STEP_NAME, sc.do_span_name),
    sc.PHASE_UNWIND: (sc.SAGA_NAME, sc.unwind_span_name),
    sc.PHASE_COMPENSATE: (sc.SAGA_STEP_NAME, sc.compensate_span_name),
    sc.PHASE_ESCALATE: (sc.SAGA_NAME, sc.escalate_span_name),
}


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_constant(name: str) -> object:
    # RFC 8259 JSON has no NaN or Infinity (Python's json reads them by default); an
    # alert quoting such arguments would be refused by every sink that parses it.
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
# The scanner json.loads uses (typeshed types make_scanner's argument as itself).
_scan = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]


def _json(text: str) -> tuple[bool, object]:
    # The scanner json.loads runs, without its two whitespace passes: when it reads the
    # whole text from the first character, json.loads gives the same value.
    try:
        value, end = _scan(text, 0)
        if end == len(text):
            return True, value
    except (StopIteration, ValueError, RecursionError):
        pass  # the plain way below decides (and says the same as ever)
    try:
        return True, _DECODER.decode(text)
    except (ValueError, RecursionError):  # nested thousands deep: not JSON we can read
        return False, None


def check(
    attributes: Mapping[str, object],
    span_name: str | None = None,
    *,
    complete: bool = False,
    run_id_rule: bool = True,
) -> list[Problem]:
    """Every way a span with these attributes breaks the contract; empty when it keeps it.

    Only spans that carry ``saga.phase`` are saga spans; give this no others.
    Type problems come first, in the attributes' order, and end the check (the
    later rules read typed values). ``span_name`` is checked with ``complete``.

    ``run_id_rule=False`` checks only that the run id is there, not
    :func:`saga_otel.semconv.run_id_problem`: for the sidecar's decoding, whose
    intake applies that rule next, to refuse such spans as ``bad_run_id``.
    """
    phase = attributes.get(sc.SAGA_PHASE, MISSING)
    # A list is unhashable: check the type before the set lookup, or a hostile span 500s.
    if not isinstance(phase, str) or phase not in sc.PHASES:
        return [Problem(sc.SAGA_PHASE, phase, f"use one of {', '.join(sorted(sc.PHASES))}")]
    out: list[Problem] = []
    for key, value in attributes.items():  # one pass over what is there, not over every name
        kind = _KINDS.get(key)
        if kind is None or type(value) is kind:
            continue
        out.append(Problem(key, value, f"must be {_KIND_NAMES[kind]}, not {type(value).__name__}"))
    if out:
        return out
    get = attributes.get
    if phase == sc.PHASE_HEARTBEAT:
        runs = get(sc.SAGA_HEARTBEAT_OPEN_RUNS, [])
        if not isinstance(runs, list | tuple) or not all(isinstance(r, str) for r in runs):
            out.append(
                Problem(sc.SAGA_HEARTBEAT_OPEN_RUNS, runs, "must be a string array of run ids")
            )
        interval = get(sc.SAGA_HEARTBEAT_INTERVAL_S, 1.0)
        if not (isinstance(interval, float) or _is_int(interval)) or not (
            math.isfinite(interval) and interval > 0
        ):
            out.append(Problem(sc.SAGA_HEARTBEAT_INTERVAL_S, interval, "must be a positive double"))
        beat = get(sc.SAGA_HEARTBEAT_BEAT, 0)
        if not _is_int(beat) or beat < 0:
            out.append(Problem(sc.SAGA_HEARTBEAT_BEAT, beat, "must be an int >= 0"))
        parts = get(sc.SAGA_HEARTBEAT_PARTS, 1)
        if not _is_int(parts) or parts < 1:
            out.append(Problem(sc.SAGA_HEARTBEAT_PARTS, parts, "must be an int >= 1"))
    elif not get(sc.SAGA_RUN_ID):
        out.append(
            Problem(
                sc.SAGA_RUN_ID,
                get(sc.SAGA_RUN_ID, MISSING),
                f"a saga {phase} span lacks it: every span of a run must carry it",
            )
        )
    elif run_id_rule and (bad_id := sc.run_id_problem(get(sc.SAGA_RUN_ID))) is not None:
        out.append(Problem(sc.SAGA_RUN_ID, get(sc.SAGA_RUN_ID), bad_id))
    if sc.SAGA_EXPORT_DROPPED in attributes:
        return out  # a marker for a refused span: identity only, whatever phase it names
    if phase in (sc.PHASE_DO, sc.PHASE_COMPENSATE):
        index = get(sc.SAGA_STEP_INDEX, MISSING)
        if not _is_int(index) or index < 0:
            out.append(Problem(sc.SAGA_STEP_INDEX, index, f"a {phase} span needs an int >= 0"))
        attempt = get(sc.SAGA_STEP_ATTEMPT, 1)
        if not _is_int(attempt) or attempt < 1:
            out.append(Problem(sc.SAGA_STEP_ATTEMPT, attempt, "counts from 1"))
        args = get(sc.SAGA_COMPENSATION_ARGS)
        if isinstance(args, str) and not isinstance(_json(args)[1], dict):
            out.append(
                Problem(
                    sc.SAGA_COMPENSATION_ARGS, args, "must be JSON object text (no NaN or Infinity)"
                )
            )
    if phase == sc.PHASE_DO:
        cls = get(sc.SAGA_STEP_CLASS)
        if cls is not None and cls not in sc.STEP_CLASSES:
            out.append(Problem(sc.SAGA_STEP_CLASS, cls, f"use one of {', '.join(sc.STEP_CLASSES)}"))
    if phase == sc.PHASE_RUN and get(sc.SAGA_RUN_STATUS) not in sc.RUN_END_STATUSES:
        out.append(
            Problem(
                sc.SAGA_RUN_STATUS,
                get(sc.SAGA_RUN_STATUS, MISSING),
                f"use one of {', '.join(sorted(sc.RUN_END_STATUSES))}",
            )
        )
    card = get(sc.SAGA_ESCALATION_CARD)
    if phase == sc.PHASE_ESCALATE and isinstance(card, str) and not _json(card)[0]:
        out.append(Problem(sc.SAGA_ESCALATION_CARD, card, "must be JSON text"))
    if complete:
        out.extend(_complete(attributes, phase, span_name))
    return out


def _complete(attributes: Mapping[str, object], phase: str, span_name: str | None) -> list[Problem]:
    get = attributes.get
    out: list[Problem] = []
    version = get(sc.SAGA_CONTRACT_VERSION, MISSING)
    if version != sc.CONTRACT_VERSION:
        out.append(Problem(sc.SAGA_CONTRACT_VERSION, version, f"must be {sc.CONTRACT_VERSION}"))
    if phase != sc.PHASE_HEARTBEAT and not get(sc.SAGA_NAME):
        out.append(
            Problem(sc.SAGA_NAME, get(sc.SAGA_NAME, MISSING), "every saga span names its saga")
        )
    for key in _PHASE_ATTRS[phase]:
        if key not in attributes:
            out.append(Problem(key, MISSING, f"a {phase} span carries it"))
    stack = get(sc.SAGA_STACK)
    if isinstance(stack, str) and not _json(stack)[0]:
        out.append(Problem(sc.SAGA_STACK, stack, "must be JSON text (a list of compensations)"))
    if span_name is not None:
        named = _NAMES.get(phase)
        want = sc.HEARTBEAT_SPAN_NAME if named is None else named[1](str(get(named[0])))
        if span_name != want:
            out.append(Problem("span name", span_name, f"name the span {want!r}"))
    return out
