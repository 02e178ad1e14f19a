"""What the adapters share, none of it tied to a framework: declarations, the mapping, undos.

Each adapter describes its framework's tools as :class:`Described` (name, the class
the framework's own metadata gives, whether it says the tool destroys), and
:func:`map_declared` applies the user's :class:`Declare` per tool name to them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

from saga_otel import CallInfo, ConfigurationError, RetryPolicy, SagaError, StepClass

IDEMPOTENCY_PARAM = "idempotency_key"
_PATH_ROOTS = ("args", "result", "snapshot")
Unannotated = Literal["refuse", "irreversible"]


class ToolErrorUnwind(SagaError):
    """A tool error the framework would hand to the model, raised to unwind the run instead
    (``unwind_on_tool_error=True``)."""


ArgsSpec = Mapping[str, Any] | Callable[[CallInfo], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Declare:
    """What the user says about one MCP tool, overriding or completing its annotations.

    ``undo`` names another tool of the same server that undoes this one.
    ``undo_args`` maps the undo's parameters to paths into the call,
    ``"result.credit_id"``, ``"args.ticket_id"``, ``"snapshot.status"`` (a
    non-string value is a constant), or is a function of the
    :class:`~saga_otel.CallInfo` (whose ``result`` is the decoded result).
    Without it, the undo's parameters are filled by name from the snapshot,
    the result and the arguments. ``snapshot`` names a read tool called with the
    do's arguments before the write: the tool becomes ``reversible``.
    """

    step_class: StepClass | str | None = None
    undo: str | None = None
    undo_args: ArgsSpec | None = None
    snapshot: str | None = None
    describe: str | Callable[[CallInfo], str] | None = None
    pivot: bool = False
    retry: RetryPolicy | None = None


@dataclass(frozen=True, slots=True)
class ToolMapping:
    """One tool's row in the review: its class, where the class came from, its undo."""

    name: str
    step_class: StepClass | None  # None: unclassified
    source: Literal["annotations", "declared", "default", "unclassified"]
    hints: str
    pivot: bool = False
    undo: str | None = None
    undo_args: str = ""
    snapshot: str | None = None
    destructive: bool = False

    @property
    def is_pivot(self) -> bool:
        return self.pivot or self.step_class is StepClass.IRREVERSIBLE


class Described(NamedTuple):
    """One framework tool as the mapping sees it."""

    name: str
    derived: StepClass | None = None  # the class the framework's metadata gives; None: none
    destructive: bool = False  # the framework says the tool may destroy
    hints: str = "-"  # that metadata, for the review


def map_declared(
    tools: Sequence[Described],
    declare: Mapping[str, Declare] | None = None,
    *,
    unannotated: Unannotated = "refuse",
    where: str = "the toolset",
) -> list[ToolMapping]:
    """Each tool's class and undo (pure; no tool is called). Unclassified rows stay in.

    Raises :class:`~saga_otel.ConfigurationError` for a declaration that cannot
    hold: an unknown tool or undo, or a destructive tool mapped to anything but
    ``irreversible`` without an undo.
    """
    declare = dict(declare or {})
    names = {t.name for t in tools}
    unknown = sorted(set(declare) - names)
    if unknown:
        raise ConfigurationError(
            f"declarations name tools {where} does not offer: {', '.join(unknown)} "
            f"(it offers: {', '.join(sorted(names)) or 'none'}); fix the names"
        )
    if unannotated not in ("refuse", "irreversible"):
        raise ConfigurationError(
            f"unannotated={unannotated!r}: use 'refuse' (the default) or 'irreversible'"
        )
    rows: list[ToolMapping] = []
    for t in tools:
        d = declare.get(t.name)
        hints, destructive, derived = t.hints, t.destructive, t.derived
        if d is None:
            if derived is None and unannotated == "irreversible":
                rows.append(
                    ToolMapping(t.name, StepClass.IRREVERSIBLE, "default", hints, destructive=True)
                )
            elif derived is None:
                rows.append(ToolMapping(t.name, None, "unclassified", hints))
            else:
                rows.append(
                    ToolMapping(t.name, derived, "annotations", hints, destructive=destructive)
                )
            continue
        for role, other in (("undo", d.undo), ("snapshot", d.snapshot)):
            if other is not None and other not in names:
                raise ConfigurationError(
                    f"tool {t.name!r} names {other!r} as its {role}, which {where} does not "
                    f"offer (it offers: {', '.join(sorted(names))}); name one of its tools"
                )
        if d.snapshot is not None and d.undo is None:
            raise ConfigurationError(
                f"tool {t.name!r} has a snapshot but no undo: add undo='<tool that writes "
                "the value back>' (often the tool itself)"
            )
        check_paths(t.name, d.undo_args)
        if d.step_class is not None:
            cls = StepClass.parse(d.step_class)
        elif d.undo is not None:
            cls = StepClass.REVERSIBLE if d.snapshot is not None else StepClass.COMPENSABLE
        elif derived is not None:
            cls = derived
        elif unannotated == "irreversible":
            cls = StepClass.IRREVERSIBLE
        else:
            rows.append(ToolMapping(t.name, None, "unclassified", hints, pivot=d.pivot))
            continue
        if d.undo is not None and not cls.pushes:
            raise ConfigurationError(
                f"tool {t.name!r} declares undo={d.undo!r} but class {cls.value}, which "
                "keeps no undo: declare it compensable (or reversible with a snapshot)"
            )
        if cls.pushes and d.undo is None:
            raise ConfigurationError(
                f"tool {t.name!r} is declared {cls.value} but names no undo: add "
                "undo='<tool that undoes it>'"
            )
        if destructive and d.undo is None and cls is not StepClass.IRREVERSIBLE:
            raise ConfigurationError(
                f"tool {t.name!r} is destructive ({hints}) and has no undo, so it can only "
                f"be irreversible, not {cls.value}: declare undo='<tool that undoes it>' or "
                "drop the class override"
            )
        rows.append(
            ToolMapping(
                t.name,
                cls,
                "declared",
                hints,
                pivot=d.pivot,
                undo=d.undo,
                undo_args=args_text(d.undo_args) if d.undo else "",
                snapshot=d.snapshot,
                destructive=destructive,
            )
        )
    return rows


def review(rows: Iterable[ToolMapping]) -> str:
    """The mapping as a table a person reads before the agent runs."""
    head = ("tool", "class", "pivot", "from", "hints", "undo")
    lines = [head]
    for r in rows:
        undo = "-"
        if r.undo:
            undo = f"{r.undo}({r.undo_args})"
            if r.snapshot:
                undo += f" after snapshot {r.snapshot}"
        cls = r.step_class.value if r.step_class else "UNCLASSIFIED"
        lines.append((r.name, cls, "yes" if r.is_pivot else "", r.source, r.hints, undo))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line[:-1], widths, strict=True)) + "  " + line[-1]
        for line in lines
    )


def refusal(rows: Sequence[ToolMapping]) -> str | None:
    missing = [r.name for r in rows if r.step_class is None]
    if not missing:
        return None
    return (
        f"tools with no class (no annotations, no declaration): {', '.join(missing)}. Declare "
        "each one's class (declare={name: Declare(step_class=...)}), or pass "
        "unannotated='irreversible' to treat them all as pivots"
    )


def args_text(spec: ArgsSpec | None) -> str:
    if spec is None:
        return "(by name)"
    if callable(spec):
        return f"{getattr(spec, '__name__', 'function')}(call)"
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in spec.items())


def check_paths(name: str, spec: ArgsSpec | None) -> None:
    if spec is None or callable(spec):
        return
    for key, value in spec.items():
        if isinstance(value, str) and value.split(".", 1)[0] not in _PATH_ROOTS:
            raise ConfigurationError(
                f"tool {name!r}: undo_args[{key!r}]={value!r} is not a path into the call; "
                "start it with result., args. or snapshot (e.g. 'result.credit_id')"
            )


def lookup(info: CallInfo, path: str) -> Any:
    root, *rest = path.split(".")
    value: Any = {"args": info.args, "result": info.result, "snapshot": info.snapshot}[root]
    for part in rest:
        if isinstance(value, Mapping):
            value = value[part]
        elif isinstance(value, list | tuple) and part.isdigit():
            value = value[int(part)]
        else:
            raise KeyError(f"{path!r}: {part!r} not found in {value!r}")
    return value


def undo_recipe(
    spec: ArgsSpec | None,
    undo_params: Sequence[str],
    decode: Callable[[Any], Any] = lambda result: result,
) -> Callable[[CallInfo], Mapping[str, Any]]:
    """The undo's arguments from the call: the declared paths, or by name."""

    def recipe(info: CallInfo) -> Mapping[str, Any]:
        info = replace(info, result=decode(info.result))
        if callable(spec):
            return dict(spec(info))
        if spec is not None:
            return {k: lookup(info, v) if isinstance(v, str) else v for k, v in spec.items()}
        # By name: the snapshot's fields, then the result's, then the do's own arguments.
        pool: dict[str, Any] = dict(info.args)
        for source in (info.result, info.snapshot):
            if isinstance(source, Mapping):
                pool.update(source)
        return {p: pool[p] for p in undo_params if p in pool and p != IDEMPOTENCY_PARAM}

    return recipe


def describe(
    d: Declare, decode: Callable[[Any], Any] = lambda result: result
) -> str | Callable[[CallInfo], str] | None:
    """The declared description; a function sees the decoded result."""
    if callable(d.describe):
        user = d.describe
        return lambda info: user(replace(info, result=decode(info.result)))
    return d.describe
