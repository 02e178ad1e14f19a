"""Tools and the registry: declarations checked up front, undo recipes, keys."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import CollectorRegistry

from saga_otel import (
    CallInfo,
    ConfigurationError,
    Saga,
    StepClass,
    Tool,
    ToolRegistry,
    UnknownToolError,
    tool,
)


def test_tool_declarations_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="names no compensation"):
        tool("compensable")(lambda: None)
    with pytest.raises(ConfigurationError, match="unknown step class 'weird'"):
        tool("weird")(lambda: None)
    reg = ToolRegistry([tool("compensable", compensate="missing")(lambda: None)])
    with pytest.raises(UnknownToolError, match="'missing'"):
        reg.check_compensations()
    with pytest.raises(UnknownToolError, match="no tool named 'nope'"):
        reg.get("nope")


def test_a_generator_tool_is_refused_at_declaration() -> None:
    # Calling it runs none of its body: an irreversible send would count as the pivot
    # crossed, a compensable write would push an undo of nothing.
    def send_reply(text: str) -> Iterator[str]:
        yield f"sent {text}"

    async def stream_reply(text: str) -> AsyncIterator[str]:
        yield f"sent {text}"

    class Sender:
        def __call__(self, text: str) -> Iterator[str]:
            yield text

    for fn in (send_reply, stream_reply, functools.partial(send_reply, "hi"), Sender()):
        with pytest.raises(ConfigurationError, match=r"generator function .* Return the result"):
            tool("irreversible", name="send_reply")(fn)
    assert tool("irreversible")(lambda text: f"sent {text}")("hi") == "sent hi"


def test_compensation_is_built_from_the_calls_own_references() -> None:
    t = tool(
        "compensable",
        compensate="reverse_credit",
        compensate_args=lambda i: {"credit_id": i.result["credit_id"]},
        describe="reverse {credit_id} of order {order_id}",
    )(lambda order_id, amount: {"credit_id": "cr_7"})
    comp = t.build_compensation(
        CallInfo("issue_credit", {"order_id": 1, "amount": 5}, {"credit_id": "cr_7"}, index=2),
        step="issue_credit",
    )
    assert comp is not None
    assert (comp.tool, dict(comp.args), comp.index) == ("reverse_credit", {"credit_id": "cr_7"}, 2)
    assert comp.description == "reverse cr_7 of order 1"


def test_an_undo_is_never_lost_for_its_description() -> None:
    """The do ran: a description that cannot be built falls back (the template, or the
    plain call for a function) saying why, and the undo is kept."""
    info = CallInfo("issue_credit", {"order_id": 1}, ["not", "a", "mapping"], index=0)

    def broken(info: CallInfo) -> str:
        raise RuntimeError("no ledger name")

    cases = [
        ("reverse {result[credit_id]}", "reverse {result[credit_id]} (description not built: "
         "TypeError: list indices must be integers or slices, not str)"),
        ("reverse {missing}", "reverse {missing} (description not built: KeyError: 'missing')"),
        ("reverse {order_id", "reverse {order_id (description not built: ValueError: "),
        (broken, "reverse_credit(credit_id='cr_7') (description not built: RuntimeError: "
         "no ledger name)"),
        (lambda i: 7, "reverse_credit(credit_id='cr_7') (description not built: TypeError: "
         "describe returned a int, not a str)"),
    ]  # fmt: skip
    for describe, expected in cases:
        t = tool(
            "compensable",
            compensate="reverse_credit",
            compensate_args=lambda i: {"credit_id": "cr_7"},
            describe=describe,
        )(lambda order_id: None)
        comp = t.build_compensation(info, step="issue_credit")
        assert comp is not None and dict(comp.args) == {"credit_id": "cr_7"}
        assert comp.description.startswith(expected), comp.description


def test_a_tool_that_takes_an_idempotency_key_gets_one() -> None:
    def with_key(x: int, idempotency_key: str) -> None: ...

    def without(x: int) -> None: ...

    assert tool("convergent")(with_key).accepts_idempotency_key
    assert not tool("convergent")(without).accepts_idempotency_key


def test_registry_refuses_two_tools_under_one_name() -> None:
    reg = ToolRegistry([tool("read", name="x")(lambda: 1)])
    with pytest.raises(ConfigurationError, match="already registered"):
        reg.register(tool("read", name="x")(lambda: 2))


def test_a_callable_object_whose_call_is_async_is_an_async_tool() -> None:
    class Fetch:
        async def __call__(self) -> int:
            return 1

    for fn in (Fetch(), functools.partial(Fetch())):
        t = Tool("fetch", fn, StepClass.READ)
        assert t.is_async
        saga = Saga("x", tools=[t], registry=CollectorRegistry())
        # Refused before it runs, as any async tool in a sync run.
        with pytest.raises(ConfigurationError, match="is async"), saga.run_sync() as run:
            run.call("fetch")
