"""What one gadget connection runs with: the ``acquisition`` and ``gadget`` config sections, then
per-connection overrides (``<configuration>`` properties, JSON parameters).

The defaults live in the section dataclasses alone (:class:`AcquisitionConfig`,
:class:`GadgetConfig`); :class:`GadgetSettings` holds one of each and routes every flat
per-connection key (``policy``, ``budget``, ``feedback``...) to the section that owns it, where
that section's own checks validate it.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, fields
from typing import Any, Literal

import yaml

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.config import ConfigError, from_dict

__all__ = ["GadgetConfig", "GadgetSettings", "SETTINGS", "settings_from_json", "settings_from_xml"]


@dataclass(frozen=True)
class GadgetConfig:
    """Settings of the gadget (config section ``gadget``); a stream's ``<configuration>`` or
    JSON parameters override them per connection (see :class:`GadgetSettings`)."""

    mar_checkpoint: str = ""
    """MAR checkpoint (.pt) applied to each reconstruction; "" = MAR off (zero-filled images),
    unless the learned policy's checkpoint carries its own (jointly trained) MAR network."""
    policy_checkpoint: str = ""
    """Trained MASC checkpoint (``masc train masc``) used when the policy is ``masc``."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (CUDA when present)."""
    feedback: Literal["none", "inband"] = "none"
    """Default next-line feedback in the stream; clients opt in per connection, because
    gadgetron_ismrmrd_client aborts on acquisitions it does not expect."""
    zmq_address: str = ""
    """ZeroMQ PUSH address of the side channel (the scanner binds it); "" = off."""
    return_zero_filled: bool = False
    """Also return the zero-filled image of each slice, as image series 2."""


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
        unknown = sorted(set(values) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"{source}: unknown setting {unknown[0]!r}; "
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


def _typed(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def settings_from_xml(element: ET.Element | str | bytes | None, base: GadgetSettings) -> GadgetSettings:
    """Apply a Gadgetron ``<configuration>`` element: ``<property name="policy" value="random"/>``
    children (Gadgetron's convention) or ``<policy>random</policy>`` children."""
    if element is None:
        return base
    if isinstance(element, (str, bytes)):
        text = element.decode("utf-8", "replace") if isinstance(element, bytes) else element
        text = text.strip().rstrip("\x00")
        if not text:
            return base
        try:
            element = ET.fromstring(text)
        except ET.ParseError as err:
            raise ConfigError(f"configuration is not valid XML: {err}") from None
    values: dict[str, Any] = {}
    for child in element.iter():
        if child is element:
            continue
        if child.tag == "property" and "name" in child.attrib:
            values[child.attrib["name"]] = _typed(child.attrib.get("value", child.text or ""))
        elif len(child) == 0 and child.tag not in ("property",) and child.text is not None:
            values[child.tag] = _typed(child.text.strip())
    return base.updated(values, "configuration")


def settings_from_json(text: str, base: GadgetSettings) -> GadgetSettings:
    """Apply JSON parameters (a text message right after the header, FIRE-client style)."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"parameters text is not valid JSON: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError("parameters text must be a JSON object")
    return base.updated(values, "parameters")
