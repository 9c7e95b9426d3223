"""Config fields checked in one place: types from the annotations, ranges from the field metadata.

``knob(default, ge=..., gt=..., lt=..., le=...)`` declares a dataclass field with a numeric range;
``_check_fields(obj)`` checks (and normalises) every field of a config dataclass against its type
annotation and range, raising ``ConfigError``/``ConfigTypeError`` that name the field, the value
and the fix. ``common.config`` (the training run) and ``common.models.configs`` (architectures) both use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import field
from typing import Any, Literal, Mapping, Optional, Union

from twinseq.common.errors import ConfigError, ConfigTypeError


def _bounds(
    *, ge: Optional[float] = None, gt: Optional[float] = None, lt: Optional[float] = None, le: Optional[float] = None
) -> dict[str, Any]:
    return {"bounds": {k: v for k, v in (("ge", ge), ("gt", gt), ("lt", lt), ("le", le)) if v is not None}}


def knob(default: Any, **bounds: float) -> Any:
    """A dataclass field with a numeric range: ``knob(1e-3, ge=0)`` (checked by ``_check_fields``)."""
    return field(default=default, metadata=_bounds(**bounds))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---------------------------------------------------------------------------------------
# Field checks: types from the annotations, ranges from the field metadata
# ---------------------------------------------------------------------------------------


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """``value`` checked against ``hint`` (and normalised: a single string for a list of strings, an
    int for a float); raises ``ConfigTypeError`` or ``ConfigError`` naming the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(name, value, inner[0])
        for alternative in inner:
            try:
                return _coerce(name, value, alternative)
            except (ConfigError, ConfigTypeError):
                continue
        raise ConfigTypeError(f"{name}={value!r} is not valid: pass {_type_name(hint)} ({_flag(name)}).")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_text = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{name}={value!r} is not valid{hint_text}; choose one of {', '.join(map(repr, args))} ({_flag(name)})."
            )
        return value
    if origin is list:
        if isinstance(value, str) and (args[0] is str or typing.get_origin(args[0]) is Literal):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigTypeError(f"{name}={value!r} is not valid: pass {_type_name(hint)} ({_flag(name)}).")
        return [_coerce(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigTypeError(
                f"{name}={value!r} is not valid: pass true or false (a boolean, not "
                f"{type(value).__name__}); on the command line use {_flag(name)} or "
                f"--no-{_flag(name)[2:]}."
            )
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(
                f"{name}={value!r} is not valid: pass an integer, not {type(value).__name__} ({_flag(name)})."
            )
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigTypeError(
                f"{name}={value!r} is not valid: pass a number, not {type(value).__name__} ({_flag(name)})."
            )
        if not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} is not valid: pass a finite number ({_flag(name)}).")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigTypeError(
                f"{name}={value!r} is not valid: pass a string, not {type(value).__name__} ({_flag(name)})."
            )
        return value
    raise AssertionError(f"unsupported config annotation {hint!r} for {name}")


_RANGE_TEXT = {"ge": ">=", "gt": ">", "lt": "<", "le": "<="}
_RANGE_OK = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "lt": lambda v, b: v < b, "le": lambda v, b: v <= b}


def _check_range(name: str, value: Any, bounds: Mapping[str, float]) -> None:
    if value is None or not bounds:
        return
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not all(_RANGE_OK[k](v, b) for k, b in bounds.items()):
            allowed = " and ".join(f"{_RANGE_TEXT[k]} {b:g}" for k, b in bounds.items())
            raise ConfigError(f"{name}={value!r} is not valid: pass a value {allowed} ({_flag(name)}).")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_CHECKS_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("twinseq_config_checks", default=True)


@contextlib.contextmanager
def deferred_checks() -> typing.Iterator[None]:
    """Build config objects without checking them; the caller then calls ``TrainConfig.validate()``.

    The CLI parser builds the tree this way, so that a bad value reaches the user through
    twinseq's error path (one line, exit 2) rather than inside the parser's own report.
    """
    token = _CHECKS_ON.set(False)
    try:
        yield
    finally:
        _CHECKS_ON.reset(token)


def _check_fields(section: Any) -> None:
    """Check (and normalise in place) every non-section field of a config dataclass: the one place."""
    # a class is hashable: lru_cache's stub says otherwise
    hints = _hints(type(section))  # type: ignore[arg-type]
    for f in dataclasses.fields(section):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        value = _coerce(f.name, getattr(section, f.name), hints[f.name])
        _check_range(f.name, value, f.metadata.get("bounds", {}))
        object.__setattr__(section, f.name, value)
