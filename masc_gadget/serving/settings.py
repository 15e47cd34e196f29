"""What one gadget connection runs with: the ``acquisition`` and ``gadget`` config sections, then
per-connection overrides (``<configuration>`` properties, JSON parameters).

The defaults live in the section dataclasses alone (:class:`AcquisitionConfig`,
:class:`GadgetConfig`); :class:`GadgetSettings` holds one of each and routes every flat
per-connection key (``policy``, ``budget``, ``feedback``...) to the section that owns it, where
that section's own checks validate it.
"""

from __future__ import annotations

import json
import logging
import re
import typing
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.config import QUOTE_CHARS, ConfigError, from_dict, quote
from masc_gadget.core.ood import check_fallback_setting
from masc_gadget.mrd.header import parse_xml

__all__ = ["ALWAYS_ALLOWED", "GadgetConfig", "GadgetSettings", "PROTOCOL", "SETTINGS", "client_values",
           "parameters_json", "settings_from_json", "settings_from_xml",
           "MAX_CONFIG_CHARS", "MAX_PARAMETERS_CHARS", "MAX_VALUE_CHARS", "MAX_JSON_DEPTH", "scalar"]

MAX_CONFIG_CHARS = 1 << 20
"""Longest configuration script (message 2) accepted; Gadgetron stream XMLs are a few kB."""
MAX_PARAMETERS_CHARS = 64 << 10
"""Longest JSON parameters text accepted."""
MAX_VALUE_CHARS = 4096
"""Longest value of one ``<configuration>`` property (a path at most)."""
MAX_JSON_DEPTH = 8
"""Deepest nesting of arrays and objects in the JSON parameters (the settings are scalars)."""

log = logging.getLogger(__name__)

_DEVICE = re.compile(r"cpu|auto|cuda(:[0-9]{1,4})?")


@dataclass(frozen=True)
class GadgetConfig:
    """Settings of the gadget (config section ``gadget``); a stream's ``<configuration>`` or
    JSON parameters override them per connection (see :class:`GadgetSettings`)."""

    mar_checkpoint: str = ""
    """MAR checkpoint (.pt) applied to each reconstruction; "" = MAR off (zero-filled images),
    unless the learned policy's checkpoint carries its own (jointly trained) MAR network."""
    policy_checkpoint: str = ""
    """Trained checkpoint of the learned policy: ``masc train masc`` for ``masc``, ``masc train
    dqn`` / ``ss-ddqn`` / ``loupe`` for those baselines (its kind must match the policy)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (CUDA when present)."""
    feedback: Literal["none", "inband", "fire"] = "none"
    """Default next-line feedback in the stream: none, inband (header-only ACQ_USER1
    acquisitions) or fire (message 1028 "feedback", masc serve only); clients opt in per
    connection, because gadgetron_ismrmrd_client aborts on messages it does not expect."""
    zmq_address: str = ""
    """ZeroMQ PUSH address of the side channel (the scanner binds it); "" = off."""
    return_zero_filled: bool = True
    """Also return the zero-filled image of each slice, as image series 2 (a derived series beside
    the MAR one, series 1, as scanners return derived images); false: series 1 only."""
    mar_fallback: str | float | bool = "auto"
    """When a slice's MAR image is served zero-filled instead (:mod:`masc_gadget.core.ood`):
    ``auto`` when its OOD score passes the threshold calibrated for the network on validation
    data (stored in its checkpoint; a network without one is always used): the early switch
    (scored on the initial lines' images; a flagged slice continues with centre-out's lines,
    for any policy) when the network has one, else the end-of-scan rule;
    ``off`` never (the score is still reported), or a number: that threshold on the end-of-scan
    score. YAML's unquoted ``off`` (false) is ``off``."""
    decide_ahead: bool = True
    """A policy that reads no image (the fixed order, centre-out, equispaced, random, the learned
    mask) decides a slice's whole episode as soon as its initial lines are in and sends every
    decision at once, each with its step index (in-band ``user_int[0]``, FIRE's ``step``, the
    side channel's ``step``): the scanner never waits for a round trip. false: one decision per
    line, as a learned policy that reads the image is asked."""
    coil_combine: Literal["rss", "sensitivity"] = "rss"
    """How a multi-coil scan's channels become one image before MAR: ``rss`` (root-sum-of-squares)
    or ``sensitivity`` (adaptive combine with sensitivities from the acquired centre lines)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mar_fallback", check_fallback_setting(self.mar_fallback))
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {quote(self.device)}")


_SECTIONS: dict[str, type] = {"acquisition": AcquisitionConfig, "gadget": GadgetConfig}

SETTINGS: dict[str, str] = {f.name: section for section, cls in _SECTIONS.items() for f in fields(cls)}
"""Every per-connection key -> the section that owns it (policy -> acquisition, ...)."""

if len(SETTINGS) != sum(len(fields(cls)) for cls in _SECTIONS.values()):  # pragma: no cover
    raise RuntimeError("the acquisition and gadget sections must not share a key")


@dataclass(frozen=True, init=False)
class GadgetSettings:
    """Everything one connection runs with: an ``acquisition`` and a ``gadget`` section.

    ``GadgetSettings()`` has the sections' defaults; ``GadgetSettings(policy="random",
    feedback="inband")`` overrides flat keys (as :meth:`updated`). Every key of either section
    reads flat too: ``settings.policy``, ``settings.budget``, ``settings.feedback``...
    """

    acquisition: AcquisitionConfig
    gadget: GadgetConfig

    def __init__(self, acquisition: AcquisitionConfig | None = None, gadget: GadgetConfig | None = None,
                 **values: Any) -> None:
        object.__setattr__(self, "acquisition", AcquisitionConfig() if acquisition is None else acquisition)
        object.__setattr__(self, "gadget", GadgetConfig() if gadget is None else gadget)
        if values:
            other = self.updated(values, "GadgetSettings")
            object.__setattr__(self, "acquisition", other.acquisition)
            object.__setattr__(self, "gadget", other.gadget)

    @classmethod
    def from_config(cls, config) -> GadgetSettings:
        """The settings of a :class:`~masc_gadget.config.Config` (its two sections)."""
        return cls(acquisition=config["acquisition"], gadget=config["gadget"])

    def updated(self, values: dict[str, Any], source: str) -> GadgetSettings:
        """A copy with the flat ``values`` applied, each in the section that owns it and checked
        by that section (``from_dict``); unknown names and bad values raise ConfigError naming
        ``source`` and the key."""
        unknown = sorted(set(values) - set(SETTINGS), key=str)
        if unknown:
            raise ConfigError(f"{source}: unknown setting {quote(unknown[0])}; "
                              f"known settings: {', '.join(sorted(SETTINGS))}")
        sections = {}
        for section in _SECTIONS:
            current = getattr(self, section)
            own = {key: value for key, value in values.items() if SETTINGS[key] == section}
            if own:
                merged = {f.name: getattr(current, f.name) for f in fields(current)}
                current = from_dict(type(current), {**merged, **own}, source)
            sections[section] = current
        return GadgetSettings(**sections)

    def flat(self) -> dict[str, Any]:
        """``{key: value}`` of every per-connection key (for logs)."""
        return {key: getattr(self, key) for key in SETTINGS}


def _flat_property(key: str, section: str) -> property:
    return property(lambda self: getattr(getattr(self, section), key),
                    doc=f"``{section}.{key}``")


# flat read access: settings.policy, settings.budget, settings.feedback... (one property per key)
for _key, _section in SETTINGS.items():
    setattr(GadgetSettings, _key, _flat_property(_key, _section))
del _key, _section


def _is_text(key: str) -> bool:
    """Whether setting ``key`` holds text (a ``str``, a choice of strings, or a union that takes
    a ``str``, such as ``str | float``: the text as written, parsed by the setting's own check)."""
    cls = _SECTIONS[SETTINGS[key]]
    hint = typing.get_type_hints(cls)[key]
    if typing.get_origin(hint) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(hint))
    return hint is str or str in typing.get_args(hint)


_INT = re.compile(r"[-+]?[0-9]{1,18}")
_FLOAT = re.compile(r"[-+]?(?:[0-9]{1,40}\.?[0-9]{0,40}|\.[0-9]{1,40})(?:[eE][-+]?[0-9]{1,3})?")
_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def scalar(text: str) -> Any:
    """A ``<configuration>`` value as the YAML scalar a config file would read (``5``, ``0.5``,
    ``1e-3``, ``true`` / ``yes`` / ``on``, ``null``), in linear time: anything else (a
    collection, an anchor, a 40-digit number) stays text, for the setting's own check to refuse
    by name."""
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    lowered = text.lower()
    if lowered in _BOOLS:
        return _BOOLS[lowered]
    if lowered in ("null", "~"):
        return None
    return text


def _typed(key: str, text: str) -> Any:
    """A ``<configuration>`` value as its setting's type: text settings take the text as it is
    (so ``value=""`` is the empty string), the others a scalar (:func:`scalar`). No YAML
    parser sees a value a client sent (it is quadratic on nested collections)."""
    if len(text) > MAX_VALUE_CHARS:
        raise ConfigError(f"configuration.{key[:QUOTE_CHARS]}: value is {len(text)} characters, "
                          f"more than the limit {MAX_VALUE_CHARS}")
    text = text.strip()
    if key not in SETTINGS or _is_text(key) or not text:
        return text  # an empty value: the setting's own check names the type it needs
    return scalar(text)


def _as_element(config: ET.Element | str | bytes) -> ET.Element | None:
    """The configuration as XML (None when empty), within the size and nesting limits."""
    if not isinstance(config, (str, bytes)):
        return config
    text = config.decode("utf-8", "replace") if isinstance(config, bytes) else config
    text = text.strip().rstrip("\x00")
    if not text:
        return None
    if len(text) > MAX_CONFIG_CHARS:
        raise ConfigError(f"configuration is {len(text)} characters, more than the limit {MAX_CONFIG_CHARS}")
    try:
        return parse_xml(text, "configuration")
    except ET.ParseError as err:
        raise ConfigError(f"configuration is not valid XML: {err}") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _settings_element(element: ET.Element) -> ET.Element | None:
    """The element whose children are the settings: a Gadgetron stream configuration
    (``<configuration><stream><external><configuration>``) gives its external module's
    ``<configuration>``; a flat ``<configuration>`` is itself."""
    stream = element.find("stream")
    if stream is None:
        return element
    inner = [ext.find("configuration") for ext in stream.iter("external")]
    inner = [c for c in inner if c is not None]
    if len(inner) > 1:
        raise ConfigError(f"configuration: the stream has {len(inner)} <external> modules with a "
                          "<configuration>; MASC takes the properties of exactly one")
    return inner[0] if inner else None


ALWAYS_ALLOWED = ("feedback", "zmq_address")
"""What a client of ``masc serve`` may always set (its JSON parameters, a configuration script):
how decisions reach it. The ZeroMQ address is still checked against ``feedback.zmq_allow``."""
PROTOCOL = ("initial", "budget", "lines_per_decision")
"""Settings that describe the scan's protocol: a client's value that differs from the server's
(and is not allowed by ``server.client_overrides``) ends the connection with an error naming
both, since serving another protocol than the scanner plays would break the scan."""


def client_values(values: dict[str, Any], operator: GadgetSettings, allowed: Sequence[str], source: str,
                  notes: list[str] | None = None) -> dict[str, Any]:
    """The values a client may apply over the ``operator``'s settings: :data:`ALWAYS_ALLOWED`, the
    keys of ``allowed`` (``server.client_overrides``; ``*``: every key) and values equal to the
    operator's. A different protocol value (:data:`PROTOCOL`) raises ConfigError naming both; any
    other refused value is left out, the operator's standing, with a message (logged at WARNING
    and added to ``notes``, for the client). Applied changes are logged at WARNING too."""
    asked = operator.updated(values, source)  # every value checked (unknown names, bad values) as sent
    kept: dict[str, Any] = {}
    for key, value in values.items():
        if key in ALWAYS_ALLOWED or "*" in allowed or key in allowed:
            kept[key] = value
            continue
        mine, theirs = getattr(operator, key), getattr(asked, key)
        if theirs == mine:
            continue
        if key in PROTOCOL:
            raise ConfigError(f"{source}.{key}: {quote(theirs)} differs from this server's {quote(mine)} "
                              f"(it serves {operator.initial} + {operator.budget} lines, "
                              f"{operator.lines_per_decision} per decision): scan with the server's protocol, or "
                              f"ask its operator to allow {key} in server.client_overrides")
        message = (f"{source}.{key}: {quote(theirs)} refused, this server serves {key} {quote(mine)}; "
                   f"its operator lets clients change it with server.client_overrides: [{key}]")
        log.warning("%s", message)
        if notes is not None:
            notes.append(message)
    if kept:
        applied = operator.updated(kept, source)
        for key in kept:
            if key in SETTINGS and key not in ALWAYS_ALLOWED and getattr(applied, key) != getattr(operator, key):
                log.warning("%s.%s: client override applied, %s instead of the server's %s (server.client_overrides)",
                            source, key, quote(getattr(applied, key)), quote(getattr(operator, key)))
    return kept


def _xml_values(element: ET.Element | str | bytes | None) -> dict[str, Any]:
    """The settings of a ``<configuration>`` (:func:`settings_from_xml`) as a flat dict."""
    if element is None:
        return {}
    element = _as_element(element)
    element = None if element is None else _settings_element(element)
    if element is None:
        return {}
    values: dict[str, Any] = {}
    for child in element.iter():
        if child is element or not isinstance(child.tag, str):
            continue
        if child.tag == "property" and "name" in child.attrib:
            name = child.attrib["name"]
            values[name] = _typed(name, child.attrib.get("value", child.text or ""))
        elif len(child) == 0 and child.tag != "property":
            values[child.tag] = _typed(child.tag, child.text or "")
    return values


def settings_from_xml(element: ET.Element | str | bytes | None, base: GadgetSettings,
                      allowed: Sequence[str] | None = None, notes: list[str] | None = None) -> GadgetSettings:
    """Apply a Gadgetron ``<configuration>`` element: ``<property name="policy" value="random"/>``
    children (Gadgetron's convention) or ``<policy>random</policy>`` children; or a whole
    Gadgetron stream configuration, whose ``<stream><external><configuration>`` gives them.
    An empty value is the empty string (``value=""``, ``<mar_checkpoint/>``). ``allowed``: a
    client's script, applied only as far as :func:`client_values` allows (None: the operator's
    own configuration, applied whole)."""
    values = _xml_values(element)
    if allowed is not None:
        values = client_values(values, base, allowed, "configuration", notes)
    return base.updated(values, "configuration") if values else base


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays / objects in a parsed JSON value nest deeper than ``limit`` (iterative,
    linear in the number of values)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth + 1 > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def parameters_json(text: str) -> dict[str, Any]:
    """The JSON object of a parameters text, within :data:`MAX_PARAMETERS_CHARS` and
    :data:`MAX_JSON_DEPTH`; ConfigError otherwise. Linear in the text's length: the C parser
    first (nesting beyond Python's recursion limit is its RecursionError), then the depth."""
    if len(text) > MAX_PARAMETERS_CHARS:
        raise ConfigError(f"parameters text is {len(text)} characters, more than the limit "
                          f"{MAX_PARAMETERS_CHARS}")
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:  # {"token": "a", "token": "b"}: which one?
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"parameters text repeats the key {quote(key)}: send each setting once")
            out[key] = value
        return out

    try:
        values = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as err:
        raise ConfigError(f"parameters text is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError(f"parameters text nests arrays / objects deeper than the limit {MAX_JSON_DEPTH}") from None
    except ConfigError:  # a repeated key
        raise
    except ValueError:  # an integer beyond Python's digit limit for int()
        raise ConfigError("parameters text has a number of thousands of digits; settings are small "
                          "numbers, names and flags") from None
    if _depth_exceeds(values, MAX_JSON_DEPTH):
        raise ConfigError(f"parameters text nests arrays / objects deeper than the limit {MAX_JSON_DEPTH}")
    if not isinstance(values, dict):
        raise ConfigError("parameters text must be a JSON object")
    return values


def settings_from_json(text: str, base: GadgetSettings, allowed: Sequence[str] | None = None,
                       notes: list[str] | None = None) -> GadgetSettings:
    """Apply JSON parameters (a text message right after the header, FIRE-client style). The key
    ``token`` is the server's authentication (``masc serve`` checks it first), not a setting.
    ``allowed``: as far as :func:`client_values` allows over ``base`` (None: everything)."""
    values = parameters_json(text)
    values.pop("token", None)
    if allowed is not None:
        values = client_values(values, base, allowed, "parameters", notes)
    return base.updated(values, "parameters") if values else base
