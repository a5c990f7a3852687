"""Recipe values checked against type annotations (the recipe sections' dataclasses and the fields of
`transformers.TrainingArguments`): `typed(key, value, annotation)` returns the value, a numeric string converted
where a float is expected, or raises a one-line `RecipeError` naming the key, the expected type and what was
given. Annotations it does not understand accept anything (TrainingArguments checks those itself)."""

from __future__ import annotations

import enum
import re
import types
import typing
from collections.abc import Sequence
from typing import Any

from unsloth_lite.errors import RecipeError

# YAML 1.1 (PyYAML) reads `2e-5` as a string; float-typed keys accept such numeric strings.
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class TypeMismatch(Exception):
    """A value that does not fit an annotation (`check_type`)."""


def describe_value(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}" if value is not None else "null"


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin in (typing.Union, types.UnionType):
        names = []
        for arg in args:  # SomeEnum | str reads as plain "str"
            name = "str" if isinstance(arg, type) and issubclass(arg, enum.Enum) else type_name(arg)
            if name not in names:
                names.append(name)
        return " or ".join(names)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (list, tuple, Sequence):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or tp is dict:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "str"
    return getattr(tp, "__name__", str(tp))


def check_type(value: Any, tp: Any) -> Any:
    """Returns `value` (a numeric string converted for float types) if it fits annotation `tp`; raises
    `TypeMismatch` otherwise. Annotations it does not understand accept anything (TrainingArguments checks later)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or isinstance(tp, (str, typing.ForwardRef, typing.TypeVar)):
        return value
    if tp is type(None) or tp is None:
        if value is None:
            return value
        raise TypeMismatch
    if origin in (typing.Union, types.UnionType):
        # An exact fit first (so `str | float` keeps '1e-3' a string), then conversions.
        for arg in args:
            try:
                if _fits_exactly(value, arg):
                    return value
            except TypeMismatch:
                pass
        for arg in args:
            try:
                return check_type(value, arg)
            except TypeMismatch:
                pass
        raise TypeMismatch
    if origin is typing.Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise TypeMismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeMismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeMismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
        raise TypeMismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeMismatch
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, str):
            return value
        raise TypeMismatch
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, list):
            raise TypeMismatch
        return [check_type(v, args[0]) for v in value] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise TypeMismatch
        if len(args) == 2:
            return {check_type(k, args[0]): check_type(v, args[1]) for k, v in value.items()}
        return value
    return value  # a class we do not know how to check (e.g. accelerate's ParallelismConfig): TrainingArguments will


def _fits_exactly(value: Any, tp: Any) -> bool:
    """Whether `value` fits `tp` without any conversion."""
    return check_type(value, tp) is value


def typed(key: str, value: Any, tp: Any) -> Any:
    try:
        return check_type(value, tp)
    except TypeMismatch:
        raise RecipeError(f"{key}: expected {type_name(tp)}, got {describe_value(value)}") from None
