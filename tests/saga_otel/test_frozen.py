"""fast_init and replacer build exactly what the dataclass's own __init__ and
dataclasses.replace build, for every record that uses them."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import saga_otel  # noqa: F401 (imports every module that decorates a record)
from saga_otel import _frozen
from saga_otel._frozen import DATACLASS_INITS, fast_init, replacer

RECORDS = sorted(DATACLASS_INITS, key=lambda c: c.__qualname__)


def _by_dataclass(cls: type[Any], *args: Any, **kwargs: Any) -> Any:
    obj = object.__new__(cls)
    DATACLASS_INITS[cls](obj, *args, **kwargs)
    return obj


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__qualname__)
def test_introspection_sees_the_dataclass_signature(cls: type[Any]) -> None:
    assert inspect.signature(cls.__init__) == inspect.signature(DATACLASS_INITS[cls])
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__qualname__)
def test_copies_and_pickles_as_before(cls: type[Any]) -> None:
    built = cls(*(f"value {i}" for i, _ in enumerate(dataclasses.fields(cls))))
    assert pickle.loads(pickle.dumps(built)) == built
    assert copy.copy(built) == built
    assert copy.deepcopy(built) == built


def test_the_hot_records_are_decorated() -> None:
    names = {c.__name__ for c in RECORDS}
    assert {"StackState", "StepRecord", "CallContext", "CallInfo", "Ticket"} <= names


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__qualname__)
def test_same_object_as_the_dataclass_init(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    values = [object() for _ in fields]
    assert cls(*values) == _by_dataclass(cls, *values)
    by_name = {f.name: v for f, v in zip(fields, values, strict=True)}
    built = cls(**by_name)
    assert built == _by_dataclass(cls, **by_name)
    assert all(getattr(built, f.name) is by_name[f.name] for f in fields)
    required = {f.name: by_name[f.name] for f in fields if f.default is dataclasses.MISSING}
    assert cls(**required) == _by_dataclass(cls, **required)  # the defaults are the same
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(built, fields[0].name, None)
    with pytest.raises(TypeError):
        cls(**by_name, not_a_field=1)
    if required:
        with pytest.raises(TypeError):
            cls()


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__qualname__)
@given(data=st.data())
def test_replacer_is_dataclasses_replace(cls: type[Any], data: st.DataObject) -> None:
    fields = [f.name for f in dataclasses.fields(cls)]
    base = cls(*(object() for _ in fields))
    changed = data.draw(st.sets(st.sampled_from(fields)) if fields else st.just(set()))
    changes = {n: object() for n in changed}
    assert replacer(cls)(base, **changes) == dataclasses.replace(base, **changes)


def test_replacer_names_an_unknown_field() -> None:
    with pytest.raises(TypeError, match=r"no field \['nope'\]"):
        replacer(RECORDS[0])(
            RECORDS[0](*(object() for _ in dataclasses.fields(RECORDS[0]))), nope=1
        )


def test_what_it_cannot_build_is_refused_at_decoration() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Post:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Clash:
        a: int
        _set_a: int

    for cls, said in (
        (NoSlots, "frozen=True, slots=True"),
        (Mutable, "frozen=True, slots=True"),
        (Factory, "default factory"),
        (Post, "__post_init__"),
        (Clash, "clashes"),
    ):
        with pytest.raises(TypeError, match=said):
            fast_init(cls)
    with pytest.raises(TypeError, match="fast_init class"):
        replacer(NoSlots)
    assert NoSlots not in _frozen.DATACLASS_INITS
