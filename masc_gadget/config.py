"""Typed configuration: one dataclass per component, YAML only overrides its defaults.

A configuration file is a mapping from *section* names to the fields of that section's
dataclass, e.g.::

    sequence:
      b0_t: 3.0
      matrix: [64, 64]

Sections are plugins: each package declares its dataclasses under the ``masc.config_sections``
entry-point group, so this module never imports the packages that build on it. Unknown
sections, unknown keys and values of the wrong type are :class:`ConfigError` naming the key
and what is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
import reprlib
import types
import typing
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, Union

import yaml

log = logging.getLogger(__name__)

SECTIONS_GROUP = "masc.config_sections"


class ConfigError(ValueError):
    """A configuration file or override does not match the typed defaults."""


QUOTE_CHARS = 80
"""At most this many characters of a value appear in an error message: values may come from a
network peer (per-connection settings), and an error must stay small whatever they hold."""

_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxtuple, _QUOTE.maxdict = 3, 4, 4, 4
_QUOTE.maxset = _QUOTE.maxfrozenset = _QUOTE.maxdeque = _QUOTE.maxarray = 4
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = QUOTE_CHARS


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` for an error message, at most ``limit`` characters, in time and memory
    bounded however large, deeply nested or self-referencing ``value`` is."""
    text = _QUOTE.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent notation, which YAML 1.1 (PyYAML) reads as a string without a dot."""


def _coerce_container(tp: Any, value: Any, where: str) -> Any:
    """:func:`_coerce` of a ``tuple``, ``list`` or ``dict`` / ``Mapping`` annotation, item by item."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: must be a mapping, got {quote(value)}")
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _coerce(key_tp, k, f"{where}.{k}"): _coerce(val_tp, v, f"{where}.{k}")
            for k, v in value.items()
        }
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: must be a list ({_type_name(tp)}), got {quote(value)}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(
                f"{where}: must have {len(args)} items ({_type_name(tp)}), got {len(value)}"
            )
        items = [_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
    else:
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (lists to tuples...)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{where}: must be {_type_name(tp)}, got {quote(value)}")
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{where}: must be {_type_name(tp)}, got {quote(value)}")
    if origin in (tuple, list, dict, Mapping):
        return _coerce_container(tp, value, where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping) and hasattr(tp, "SHORTHAND_KEY"):  # e.g. corruption: 0.1
            value = {tp.SHORTHAND_KEY: value}
        return from_dict(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{where}: must be {_type_name(tp)}, got {quote(value)}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: must be true or false, got {quote(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: must be an integer, got {quote(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise ConfigError(f"{where}: must be a number a float holds, got {quote(value)}") from None
        if isinstance(value, str) and len(value) <= 32 and _EXPONENT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
        raise ConfigError(f"{where}: must be a number, got {quote(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: must be a string, got {quote(value)}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{where}: must be {_type_name(tp)}, got {quote(value)}")
    return value


def _nest_flat_keys(cls: type, data: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """``data`` with the keys a dataclass declares moved (its ``FLAT_KEYS``: old key -> ``entry.key``)
    put where they now live, each with a note; ConfigError when both spellings are given."""
    moved = {key: path for key, path in getattr(cls, "FLAT_KEYS", {}).items() if key in data}
    if not moved:
        return data
    out = {k: v for k, v in data.items() if k not in moved}
    hints = typing.get_type_hints(cls)
    for key, path in moved.items():
        entry, _, name = path.partition(".")
        nested = out.get(entry, {})
        if not isinstance(nested, Mapping) and hasattr(hints.get(entry), "SHORTHAND_KEY"):
            nested = {hints[entry].SHORTHAND_KEY: nested}  # e.g. corruption: 0.1
        if not isinstance(nested, Mapping):
            raise ConfigError(f"{prefix}{entry}: must be a mapping of keys, got {quote(nested)}")
        if name in nested:
            raise ConfigError(f"{prefix}{key} and {prefix}{path} are one setting: give {prefix}{path} only")
        out[entry] = {**nested, name: data[key]}
        log.warning("%s%s is now %s%s (the old key works until 0.4)", prefix, key, prefix, path)
    return out


def from_dict(cls: type, data: Mapping[str, Any] | None, where: str = "") -> Any:
    """Build dataclass ``cls`` from its defaults overridden by ``data``.

    Raises ConfigError naming ``where.key`` for unknown keys and wrong types, and re-raises
    the dataclass's own ``__post_init__`` ValueErrors as ConfigError with the section name.
    """
    data = {} if data is None else data
    prefix = f"{where}." if where else ""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: must be a mapping of keys, got {quote(data)}")
    data = _nest_flat_keys(cls, data, prefix)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{str(unknown[0])[:QUOTE_CHARS]}; allowed keys of {where or cls.__name__}: "
            + ", ".join(sorted(fields))
        )
    kwargs = {name: _coerce(hints[name], value, f"{prefix}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where or cls.__name__}: {err}") from None


def to_dict(obj: Any) -> Any:
    """JSON/YAML-able plain data of a dataclass (tuples become lists, enums their values)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["sequence.b0_t=1.5", "dataset.subjects=4"]`` -> nested dict; values parsed as YAML."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or "." not in key:
            raise ConfigError(
                f"override {item!r} must look like section.key=value (e.g. sequence.b0_t=1.5)"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({err})") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override")
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any], sections: Mapping[str, type] | None = None
           ) -> dict[str, Any]:
    """Overrides replace whole field values (a dict-valued field such as
    ``eval.accelerations`` is replaced, not merged); sections merge key by key, and so do the
    entries of a section that are settings of their own (a dataclass-typed field of the
    section's class in ``sections``, such as ``mar_train.run``)."""
    out = dict(base)
    for section, fields in extra.items():
        if isinstance(fields, Mapping) and isinstance(out.get(section), Mapping):
            cls = (sections or {}).get(section)
            nested = _nested_fields(cls) if isinstance(cls, type) and dataclasses.is_dataclass(cls) else {}
            out[section] = {**out[section], **{
                key: _merge({key: out[section][key]}, {key: value}, nested)[key]
                if key in nested and isinstance(value, Mapping) and isinstance(out[section].get(key), Mapping)
                else value for key, value in fields.items()}}
        else:
            out[section] = fields
    return out


def _nested_fields(cls: type) -> dict[str, type]:
    """The fields of dataclass ``cls`` whose type is a dataclass (settings of their own)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints.get(f.name), type) and dataclasses.is_dataclass(hints[f.name])}


@dataclasses.dataclass(frozen=True)
class UnavailableSection:
    """A section whose package cannot be imported (an optional dependency group is not
    installed, e.g. the training stack next to a serving-only gadget). Its values are kept
    as the file gives them, unvalidated: nothing installed can use them."""

    name: str
    error: str


def config_sections() -> dict[str, type | UnavailableSection]:
    """Section name -> dataclass, from the installed ``masc.config_sections`` entry points."""
    sections: dict[str, type | UnavailableSection] = {}
    for ep in metadata.entry_points(group=SECTIONS_GROUP):
        try:
            sections[ep.name] = ep.load()
        except ImportError as err:
            sections[ep.name] = UnavailableSection(ep.name, str(err))
    return sections


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated configuration: every known section, defaults filled in."""

    sections: Mapping[str, Any]
    source: str | None = None

    def __getitem__(self, name: str) -> Any:
        try:
            return self.sections[name]
        except KeyError:
            raise ConfigError(
                f"no config section {name!r}; known sections: " + ", ".join(sorted(self.sections))
            ) from None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("sections", "source"):
            raise AttributeError(name)
        try:
            return self.sections[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return {name: to_dict(value) for name, value in self.sections.items()}


def build_config(
    data: Mapping[str, Any] | None = None,
    overrides: Iterable[str] = (),
    sections: Mapping[str, type] | None = None,
    source: str | None = None,
) -> Config:
    """Validate ``data`` (+ ``key=value`` overrides) against all sections."""
    sections = dict(config_sections() if sections is None else sections)
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source or 'config'}: top level must be a mapping of sections")
    merged = _merge(dict(data), parse_overrides(overrides), sections)
    unknown = sorted(set(merged) - set(sections))
    if unknown:
        raise ConfigError(
            f"unknown config section {unknown[0]!r}; known sections: " + ", ".join(sorted(sections))
        )
    built = {
        name: dict(merged.get(name) or {}) if isinstance(cls, UnavailableSection)
        else from_dict(cls, merged.get(name), name)
        for name, cls in sections.items()
    }
    return Config(built, source)


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    sections: Mapping[str, type] | None = None,
) -> Config:
    """Read a YAML config (or only defaults when ``path`` is None) and apply overrides.
    ``A.yaml,B.yaml`` layers several files: each later one overrides the earlier ones' keys,
    section by section (as ``--set`` does)."""
    data: dict[str, Any] = {}
    files = [] if path is None else [Path(p) for p in str(path).split(",") if p.strip()]
    for file in files:
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist")
        try:
            layer = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {file} is not valid YAML: {err}") from None
        if not isinstance(layer, Mapping):
            raise ConfigError(f"{file}: top level must be a mapping of sections")
        data = _merge(data, layer, config_sections() if sections is None else sections)
    return build_config(data, overrides, sections, None if path is None else str(path))
