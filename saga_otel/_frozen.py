"""A cheaper ``__init__`` for the frozen, slotted records built on every step.

A frozen dataclass's generated ``__init__`` sets each field with
``object.__setattr__(self, name, value)``, the frozen guard's way around, which
looks the slot up by name on every call. :func:`fast_init` gives the class an
``__init__`` with the same signature that stores each value through its slot's
descriptor instead, fetched once: about half the cost for a record of a dozen
fields (the compensation stack's state is rebuilt several times per step).
Everything else stays the dataclass's: equality, hashing, ``repr``, and the
``FrozenInstanceError`` on assignment. ``tests/saga_otel/test_frozen.py``
compares every decorated record with the dataclass's own ``__init__``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Each decorated class and the __init__ dataclasses generated for it (kept for the tests).
DATACLASS_INITS: dict[type[Any], Callable[..., None]] = {}


def _setters(cls: type[Any], names: list[str]) -> dict[str, Any]:
    """``_set_<name>``: each field's slot descriptor's ``__set__``, for generated code."""
    return {f"_set_{n}": getattr(cls, n).__set__ for n in names}


def fast_init(cls: type[T]) -> type[T]:
    """Decorate a ``@dataclass(frozen=True, slots=True)`` class (applied above it).

    Only plain records qualify: every field in ``__init__``, positional or
    keyword, with no default factory and no ``__post_init__``; anything else is
    refused here, at import, rather than built differently from the dataclass.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init needs a @dataclass(frozen=True, slots=True) class, got {cls!r}")
    if hasattr(cls, "__post_init__") or not params.init:
        raise TypeError(f"fast_init cannot keep {cls.__name__}'s own __init__ or __post_init__")
    names: list[str] = []
    env: dict[str, Any] = {}
    signature: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING:
            raise TypeError(
                f"fast_init cannot build {cls.__name__}.{f.name} (init=False, kw_only or a "
                "default factory): leave the dataclass's __init__ on this class"
            )
        if f.name == "self" or f.name.startswith(("_set_", "_default_")):
            raise TypeError(
                f"fast_init cannot build {cls.__name__}.{f.name}: the name clashes with the "
                "generated __init__'s own; rename the field or leave the dataclass's __init__"
            )
        names.append(f.name)
        if f.default is dataclasses.MISSING:
            signature.append(f.name)
        else:
            env[f"_default_{f.name}"] = f.default
            signature.append(f"{f.name}=_default_{f.name}")
    env.update(_setters(cls, names))
    body = "".join(f"    _set_{n}(self, {n})\n" for n in names) or "    pass\n"
    exec(f"def __init__(self, {', '.join(signature)}):\n{body}", env)
    init = env["__init__"]
    generated = cls.__init__
    # What introspection reads (inspect.signature, typing.get_type_hints) stays the same.
    init.__qualname__ = generated.__qualname__
    init.__module__ = cls.__module__
    init.__annotations__ = dict(generated.__annotations__)
    init.__doc__ = generated.__doc__
    DATACLASS_INITS[cls] = generated
    setattr(cls, "__init__", init)  # noqa: B010 (mypy refuses assigning to a method)
    return cls


def replacer(cls: type[T]) -> Callable[..., T]:
    """``dataclasses.replace`` for one :func:`fast_init` class: ``replace(obj, **changes)``.

    One function per set of changed field names, made on first use (a handful per
    class): it copies the other fields and stores the changes through the slots'
    descriptors, with no ``__init__`` call and no walk over ``fields()``.
    """
    if cls not in DATACLASS_INITS:
        raise TypeError(f"replacer needs a fast_init class, got {cls!r}")
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    known = frozenset(names)
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls, **_setters(cls, names)}
    made: dict[frozenset[str], Callable[[T, dict[str, Any]], T]] = {}

    def make(key: frozenset[str]) -> Callable[[T, dict[str, Any]], T]:
        if not known.issuperset(key):
            raise TypeError(f"{cls.__name__} has no field {sorted(key - known)}")
        body = "".join(
            f"    _set_{n}(new, changes[{n!r}])\n" if n in key else f"    _set_{n}(new, old.{n})\n"
            for n in names
        )
        scope = dict(env)
        exec(f"def copy(old, changes):\n    new = _new(_cls)\n{body}    return new\n", scope)
        made[key] = scope["copy"]
        return made[key]

    def replace(obj: T, /, **changes: Any) -> T:
        key = frozenset(changes)
        copy = made.get(key) or make(key)
        return copy(obj, changes)

    return replace
