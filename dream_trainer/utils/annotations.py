"""Checking a value against a type annotation, for the fields users add to their config dataclasses.

`field_checks(cls, skip)` reads the annotations of a dataclass's fields once and returns one
`FieldCheck` per field it can check; `FieldCheck.problem(value)` is None for a value of the annotated
type, else what was expected. Handled: None, bool, int (bool is not one), float (an int is one),
str, bytes, paths (`pathlib` types take a str too), enums (their members), `Literal`, `Optional` /
`Union` / `X | Y`, `list` / `tuple` / `set` / `frozenset` / `Sequence` and `dict` / `Mapping` with their
item types, `type[X]`, `Callable`, `Annotated` and plain classes. An annotation that cannot be resolved
(a name only visible inside a function, `TYPE_CHECKING` imports) or understood (a `TypeVar`, ...) is
skipped: such a field is not checked.
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import enum
import inspect
import os
import pathlib
import reprlib
import sys
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

__all__ = ["FieldCheck", "field_checks", "short_repr"]

_Check = Callable[[Any], bool]


class _Rule(NamedTuple):
    ok: _Check
    expected: str  # "a float", "a list of int", "one of 'a', 'b'"


class FieldCheck(NamedTuple):
    """The check of one dataclass field: its name, the rule its annotation gives, and its declared
    default, which is accepted as it is (`max_len: int = None` is the class author's own choice)."""

    name: str
    rule: _Rule
    default: Any

    def problem(self, value: Any) -> str | None:
        """None when `value` fits the annotation, else `expected ..., got a <type>` (the type left out when
        it is the expected container's, e.g. a list with an item of the wrong type)."""
        if value is self.default or self.rule.ok(value):
            return None
        got = _article(type(value).__name__)
        if any(arm.startswith(got + " ") for arm in self.rule.expected.split(" or ")):
            return f"expected {self.rule.expected}"
        return f"expected {self.rule.expected}, got {got}"


_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def short_repr(value: Any) -> str:
    """`repr(value)`, shortened (`...`) so that an error's first line stays short."""
    return _REPR.repr(value)


def field_checks(cls: type, skip: Iterable[str] = ()) -> tuple[FieldCheck, ...]:
    """One check per field of the dataclass `cls` (except those in `skip`) whose annotation is understood."""
    skipped = set(skip)
    checks = []
    for f in dataclasses.fields(cls):
        if f.name in skipped:
            continue
        annotation = _resolve(cls, f.name, f.type)
        rule = None if annotation is _UNRESOLVED else _rule(annotation)
        if rule is not None:
            checks.append(FieldCheck(f.name, rule, f.default))
    return tuple(checks)


_UNRESOLVED = object()


def _resolve(cls: type, name: str, annotation: Any) -> Any:
    """The annotation object; a string one is evaluated where the class that declared the field lives."""
    if not isinstance(annotation, str):
        return annotation
    owner = next((k for k in cls.__mro__ if name in inspect.get_annotations(k)), cls)
    module = sys.modules.get(owner.__module__)
    namespace = dict(vars(module)) if module is not None else {}
    try:
        return eval(annotation, namespace, dict(vars(owner)))  # as typing.get_type_hints does
    except Exception:
        return _UNRESOLVED


def _article(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SIMPLE: dict[Any, _Rule] = {
    type(None): _Rule(lambda v: v is None, "None"),
    bool: _Rule(lambda v: isinstance(v, bool), "True or False"),
    int: _Rule(_is_int, "an int"),
    float: _Rule(lambda v: isinstance(v, float) or _is_int(v), "a float"),
    complex: _Rule(lambda v: isinstance(v, (complex, float)) or _is_int(v), "a complex number"),
    str: _Rule(lambda v: isinstance(v, str), "a str"),
    bytes: _Rule(lambda v: isinstance(v, bytes), "bytes"),
    os.PathLike: _Rule(lambda v: isinstance(v, (str, os.PathLike)), "a path (str or pathlib.Path)"),
}
_SEQUENCES: dict[Any, tuple[tuple[type, ...], str]] = {
    list: ((list,), "a list"),
    tuple: ((tuple, list), "a tuple"),
    set: ((set, frozenset), "a set"),
    frozenset: ((set, frozenset), "a frozenset"),
    cabc.Sequence: ((list, tuple), "a sequence"),
    cabc.MutableSequence: ((list,), "a list"),
    cabc.Set: ((set, frozenset), "a set"),
    cabc.MutableSet: ((set,), "a set"),
    cabc.Iterable: ((list, tuple, set, frozenset), "a list"),
    cabc.Collection: ((list, tuple, set, frozenset), "a list"),
}
_MAPPINGS = (dict, cabc.Mapping, cabc.MutableMapping)


def _rule(tp: Any) -> _Rule | None:
    """The rule of annotation `tp`, or None when it is not understood (the field is not checked)."""
    if tp is None:
        tp = type(None)
    if tp is Any or isinstance(tp, (typing.TypeVar, str, typing.ForwardRef)):
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    try:
        simple = _SIMPLE.get(origin or tp)
    except TypeError:  # an unhashable annotation object
        return None
    if simple is not None:
        return simple
    if origin is typing.Annotated:
        return _rule(args[0])
    if origin is typing.Literal:
        return _literal(args)
    if origin is typing.Union or origin is types.UnionType:
        return _union(args)
    if origin is type:
        return _subclass(args)
    if tp is cabc.Callable or origin is cabc.Callable:
        return _Rule(callable, "a callable")
    if tp in _SEQUENCES or origin in _SEQUENCES:
        return _sequence(origin or tp, args)
    if tp in _MAPPINGS or origin in _MAPPINGS:
        return _mapping(args)
    if inspect.isclass(tp):
        return _class(tp)
    return None


def _literal(choices: tuple[Any, ...]) -> _Rule:
    def ok(v: Any) -> bool:  # 1 == True: a bool matches only a bool choice
        return any(v == c and isinstance(v, bool) == isinstance(c, bool) for c in choices)

    return _Rule(ok, "one of " + ", ".join(repr(c) for c in choices))


def _union(arms: tuple[Any, ...]) -> _Rule | None:
    rules = [_rule(a) for a in arms]
    if any(r is None for r in rules):
        return None  # one arm is not understood: any value might be meant for it
    checks = [r.ok for r in rules if r is not None]
    expected = " or ".join(dict.fromkeys(r.expected for r in rules if r is not None))
    return _Rule(lambda v: any(check(v) for check in checks), expected)


def _subclass(args: tuple[Any, ...]) -> _Rule | None:
    base = args[0] if args else object
    if not inspect.isclass(base):
        return None
    return _Rule(lambda v: inspect.isclass(v) and issubclass(v, base), f"a subclass of {base.__qualname__}")


def _sequence(origin: Any, args: tuple[Any, ...]) -> _Rule | None:
    kinds, noun = _SEQUENCES[origin]
    if not args:
        return _Rule(lambda v: isinstance(v, kinds), noun)
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        rules = [_rule(a) for a in args]
        if any(r is None for r in rules):
            return _Rule(lambda v: isinstance(v, kinds), noun)
        items = [r.ok for r in rules if r is not None]
        shape = ", ".join(r.expected for r in rules if r is not None)

        def fixed(v: Any) -> bool:
            values: Any = v  # (isinstance with a tuple of types would narrow it to object)
            return isinstance(v, kinds) and len(values) == len(items) and all(map(_call, items, values))

        return _Rule(fixed, f"a tuple of ({shape})")
    item = _rule(args[0])
    if item is None:
        return _Rule(lambda v: isinstance(v, kinds), noun)
    check = item.ok

    def each(v: Any) -> bool:
        values: Any = v
        return isinstance(v, kinds) and all(map(check, values))

    return _Rule(each, f"{noun} of {_plural(item.expected)}")


def _call(check: _Check, value: Any) -> bool:
    return check(value)


def _mapping(args: tuple[Any, ...]) -> _Rule:
    key = _rule(args[0]) if args else None
    value = _rule(args[1]) if len(args) > 1 else None
    if key is None and value is None:
        return _Rule(lambda v: isinstance(v, cabc.Mapping), "a dict")
    key_ok = key.ok if key is not None else (lambda _: True)
    value_ok = value.ok if value is not None else (lambda _: True)
    shape = f"a dict of {_plural(key.expected) if key else 'keys'} to {_plural(value.expected) if value else 'values'}"
    return _Rule(lambda v: isinstance(v, cabc.Mapping) and all(key_ok(k) and value_ok(x) for k, x in v.items()), shape)


def _class(tp: type) -> _Rule:
    if issubclass(tp, enum.Enum):
        members = ", ".join(f"{tp.__name__}.{m.name}" for m in tp)
        return _Rule(lambda v: isinstance(v, tp), f"a member of {tp.__name__} ({members})")
    if issubclass(tp, pathlib.PurePath):
        return _SIMPLE[os.PathLike]
    return _Rule(lambda v: isinstance(v, tp), _article(tp.__qualname__))


def _plural(expected: str) -> str:
    """`an int` -> `int`, `a list of str` -> `list of str`: an item type after `a list of`."""
    for article in ("a ", "an "):
        if expected.startswith(article):
            return expected[len(article) :]
    return expected
