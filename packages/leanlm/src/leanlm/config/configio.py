"""Config plumbing shared by every section: `ConfigError`, value checks, mapping <-> dataclass.

A section is a frozen keyword-only dataclass; `from_dict` fills one from a (TOML) mapping and
names the dotted key of the first unknown key, wrong type or impossible value. `with_overrides`
lays command-line `KEY=VALUE` overrides (TOML values) over such a mapping first. A section that
wraps a library's config builds it inside `library_errors`, which turns the library's
`ValueError` / `TypeError` into a `ConfigError` naming the section's key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
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
        _finite(name, value)
        if value < 0:
            meaning = f" (0 = {zero})" if zero else ""
            raise ConfigError(name, f"must be >= 0{meaning}, got {value!r}")


def positive(obj: object, *names: str) -> None:
    """`ConfigError` unless every named field is > 0."""
    for name in names:
        value = getattr(obj, name)
        _finite(name, value)
        if value <= 0:
            raise ConfigError(name, f"must be > 0, got {value!r}")


def _finite(key: str, value: Any) -> None:
    """`ConfigError` naming `key` when `value` is a NaN or infinite float.

    TOML has `nan` and `inf`, and NaN passes every comparison a range check makes.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")


def check_finite(config: object) -> None:
    """`ConfigError` naming the dotted key of the first NaN / inf float in `config`.

    `config` is a dataclass; its sections and their lists and tables are searched too (keys
    like `pretrain.lr`, `pretrain.betas[0]`).
    """

    def walk(value: Any, key: str) -> None:
        _finite(key, value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name), f"{key}.{field.name}" if key else field.name)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{key}[{i}]")
        elif isinstance(value, Mapping):
            for name, item in value.items():
                walk(item, f"{key}.{name}")

    walk(config, "")


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


def convert_value(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` and convert TOML lists / tables."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        # of the same type too: `True == 1` and `2.0 == 2`, but neither is the int a key takes
        for choice in args:
            if type(value) is type(choice) and value == choice:
                return value
        got = f"{type(value).__name__} {value!r}" if value in args else repr(value)
        raise ConfigError(key, f"must be one of {list(args)}, got {got}")
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert_value(value, inner[0], key)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert_value(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(key, f"must have {len(args)} items, got {len(value)}: {value!r}")
        return tuple(
            convert_value(v, a, f"{key}[{i}]")
            for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a table, got {type(value).__name__} {value!r}")
        return {
            convert_value(k, args[0], key): convert_value(v, args[1], f"{key}.{k}")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a table, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, prefix=key)  # type: ignore[arg-type]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, float):
        _finite(key, value)
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
            hint = f"; did you mean `{close[0]}`?" if close else ""
            hint += f"; valid keys: {sorted(fields)}"
            raise ConfigError(dotted(key), f"unknown key{hint}")
    kwargs = {key: convert_value(value, hints[key], dotted(key)) for key, value in data.items()}
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


# ---------------------------------------------------------------------------------------------
# Command-line overrides: `--set pretrain.lr=3e-4`.

_DOTTED_KEY = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
"""A dotted key of TOML bare keys, e.g. `pretrain.lr`."""


def parse_override(item: str) -> dict[str, Any]:
    """`KEY=VALUE` as the nested mapping the TOML line `KEY = VALUE` reads as.

    The value follows TOML's rules, as in a config file: `3e-4` is a float, `512` an int,
    `true` a bool, `"text"` a string (quoted), `[1, 2]` a list, `{lr = 1e-3}` a table.

    Raises:
        ConfigError: naming the key, when the item is not `KEY=VALUE` with a dotted key of
            bare TOML keys and one TOML value.
    """
    key, sep, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not _DOTTED_KEY.match(key):
        raise ConfigError(
            key or item,
            f"--set {item!r} must be KEY=VALUE with a dotted KEY, e.g. --set pretrain.lr=3e-4",
        )
    try:
        parsed = tomllib.loads(f"value = {value}")
    except tomllib.TOMLDecodeError:
        parsed = {}
    if list(parsed) != ["value"]:
        example = value if re.fullmatch(r"[\w./:-]+", value) else "text"
        raise ConfigError(
            key,
            f"--set value {value!r} is not one TOML value; a string needs quotes, e.g. "
            f"--set '{key}=\"{example}\"'",
        )
    nested: dict[str, Any] = {}
    inner = nested
    *parents, last = key.split(".")
    for part in parents:
        inner = inner.setdefault(part, {})
    inner[last] = parsed["value"]
    return nested


def merge_tables(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `update` laid over it: tables merge key by key, other values replace."""
    merged = dict(base)
    for key, value in update.items():
        old = merged.get(key)
        both = isinstance(old, Mapping) and isinstance(value, Mapping)
        merged[key] = merge_tables(old, value) if both else value  # type: ignore[arg-type]
    return merged


def with_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A config mapping with `--set KEY=VALUE` overrides applied in order (see `parse_override`).

    The result goes through `from_dict` like a TOML file's mapping, so an override is checked
    (unknown keys, types, values) exactly as the same line in the file would be.
    """
    merged = dict(data)
    for item in overrides:
        merged = merge_tables(merged, parse_override(item))
    return merged
