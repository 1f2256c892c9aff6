"""Config plumbing shared by every section: `ConfigError`, value checks, mapping <-> dataclass.

A section is a frozen keyword-only dataclass; `from_dict` fills one from a (TOML) mapping and
names the dotted key of the first unknown key, wrong type or impossible value. A section that
wraps a library's config builds it inside `library_errors`, which turns the library's
`ValueError` / `TypeError` into a `ConfigError` naming the section's key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad configuration value; `key` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"config key `{key}`: {message}")

    def under(self, section: str) -> ConfigError:
        """The same error with `section.` prepended to its key."""
        return ConfigError(f"{section}.{self.key}", self.message)


def non_negative(obj: object, *names: str, zero: str = "") -> None:
    """`ConfigError` unless every named field is >= 0; `zero` says what 0 means, if anything."""
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            meaning = f" (0 = {zero})" if zero else ""
            raise ConfigError(name, f"must be >= 0{meaning}, got {value!r}")


def positive(obj: object, *names: str) -> None:
    """`ConfigError` unless every named field is > 0."""
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(name, f"must be > 0, got {value!r}")


_NAMED = re.compile(r"`(\w+)`\s*")


@contextlib.contextmanager
def library_errors(section: object, keys: Mapping[str, str] | None = None) -> Iterator[None]:
    """Turn a library config's `ValueError` / `TypeError` into a `ConfigError` naming our key.

    The library names the argument it rejects in backticks first (the house style). That name
    is looked up in `keys` (library argument -> field of `section`), else taken as is when
    `section` has such a field; the message keeps the library's words. An error naming no field
    of `section` is re-raised unchanged (a bug here, not a bad config).
    """
    try:
        yield
    except (ValueError, TypeError) as err:
        text = str(err)
        match = _NAMED.match(text)
        fields = {f.name for f in dataclasses.fields(section)}  # type: ignore[arg-type]
        name = match[1] if match else ""
        if keys and name in keys:  # the library's name for part of our value
            key = keys[name]
            raise ConfigError(key, f"{getattr(section, key)!r}: {text}") from None
        if match and name in fields:
            raise ConfigError(name, text[match.end() :]) from None
        raise


# ---------------------------------------------------------------------------------------------
# Mapping <-> dataclass conversion with key-naming errors.


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` and convert TOML lists / tables."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(key, f"must have {len(args)} items, got {len(value)}: {value!r}")
        return tuple(
            _convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a table, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, prefix=key)  # type: ignore[arg-type]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (tp in (int, float) and isinstance(value, bool)) or not isinstance(value, tp):
        raise ConfigError(key, f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build the dataclass `cls` from a (TOML) mapping, checking keys, types and values.

    Raises:
        ConfigError: naming the dotted key of the first unknown key, wrong type or bad value.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    dotted = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: k)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else f"; valid keys: {sorted(fields)}"
            raise ConfigError(dotted(key), f"unknown key{hint}")
    kwargs = {key: _convert(value, hints[key], dotted(key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise (err.under(prefix) if prefix else err) from None


def to_dict(config: Any) -> dict[str, Any]:
    """A config as plain TOML-friendly data (tuples become lists, `None` values are dropped)."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return clean(dataclasses.asdict(config))  # type: ignore[no-any-return]
