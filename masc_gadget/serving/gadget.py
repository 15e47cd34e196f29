"""The MASC streaming gadget: one plain function over a connection.

``masc(connection)`` runs inside Gadgetron as an external Python module (``<external><execute
name="masc_gadget.serving.gadget" target="masc" type="python"/>``), reading its settings from the stream's
``<configuration>`` element, and the standalone ``masc serve`` runs the very same
:func:`process` loop over its own connections. For every acquired line it updates the slice's
k-space buffer (the scanner is the authority on what was acquired), and once the slice's initial
lines are in it reconstructs, corrects (MAR) and asks the policy for the next line, which goes
back in-band (a header-only ``ACQ_USER1`` acquisition, opt-in) and / or over the ZeroMQ side
channel. Each finished slice goes back as an ``ismrmrd.Image``.

Debugging: ``python -m masc_gadget.serving.gadget PORT`` listens on PORT for one Gadgetron connection.
"""

from __future__ import annotations

import json
import logging
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal

import ismrmrd
import numpy as np
import yaml

from masc_gadget import __version__
from masc_gadget.config import ConfigError, from_dict, to_dict
from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings, SliceResult
from masc_gadget.mrd.feedback import ZmqFeedback, feedback_acquisition, is_feedback
from masc_gadget.mrd.header import encoding_geometry

log = logging.getLogger(__name__)

# acquisitions that carry no imaging data for this reconstruction
_SKIP_FLAGS = (
    ismrmrd.ACQ_IS_NOISE_MEASUREMENT,
    ismrmrd.ACQ_IS_NAVIGATION_DATA,
    ismrmrd.ACQ_IS_PHASECORR_DATA,
    ismrmrd.ACQ_IS_DUMMYSCAN_DATA,
    ismrmrd.ACQ_IS_PARALLEL_CALIBRATION,
)


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


@dataclass(frozen=True)
class GadgetSettings:
    """Everything one connection runs with: the acquisition section, the gadget section, then
    per-connection overrides from ``<configuration>`` properties or JSON text parameters."""

    policy: str = "center-out"
    initial: int = 2
    budget: int = 18
    seed: int = 0
    mar_checkpoint: str = ""
    policy_checkpoint: str = ""
    device: str = "auto"
    feedback: Literal["none", "inband"] = "none"
    zmq_address: str = ""
    return_zero_filled: bool = False

    @classmethod
    def from_config(cls, config) -> "GadgetSettings":
        acq, gad = config["acquisition"], config["gadget"]
        return cls(policy=acq.policy, initial=acq.initial, budget=acq.budget, seed=acq.seed,
                   mar_checkpoint=gad.mar_checkpoint, policy_checkpoint=gad.policy_checkpoint,
                   device=gad.device, feedback=gad.feedback,
                   zmq_address=gad.zmq_address, return_zero_filled=gad.return_zero_filled)

    def updated(self, values: dict[str, Any], source: str) -> "GadgetSettings":
        """A copy with ``values`` applied; unknown names and bad values raise ConfigError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown setting {unknown[0]!r}; known settings: {', '.join(sorted(known))}")
        merged = {**to_dict(self), **values}
        return from_dict(GadgetSettings, merged, source)


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


def make_image(result: SliceResult, template: ismrmrd.AcquisitionHeader | None, header: Any,
               series: int, zero_filled: bool = False) -> ismrmrd.Image:
    """The finished slice as an ``ismrmrd.Image`` (magnitude, float32, (y, x) = (PE, RO)) with
    meta attributes listing the acquired lines, the policy and the versions."""
    data = (result.zero_filled if zero_filled else result.image).astype(np.float32)
    image = ismrmrd.Image.from_array(data, transpose=False)
    image.image_type = ismrmrd.IMTYPE_MAGNITUDE
    image.image_series_index = series
    image.image_index = result.slice + 1
    image.slice = result.slice
    if template is not None:
        for name in ("position", "read_dir", "phase_dir", "slice_dir", "patient_table_position"):
            setattr(image, name, tuple(getattr(template, name)))
        image.measurement_uid = template.measurement_uid
        image.acquisition_time_stamp = template.acquisition_time_stamp
        image.repetition = template.idx.repetition
        image.contrast = template.idx.contrast
    try:
        fov = header.encoding[0].reconSpace.fieldOfView_mm
        image.field_of_view = (float(fov.x), float(fov.y), float(fov.z))
    except (AttributeError, IndexError):
        pass
    meta = ismrmrd.Meta()
    meta["MASC.lines"] = [int(v) for v in result.lines]
    meta["MASC.decided"] = [int(v) for v in result.decided]
    meta["MASC.policy"] = result.policy
    meta["MASC.mar"] = "none (zero-filled)" if zero_filled else result.mar
    meta["MASC.version"] = __version__
    meta["DataRole"] = "Image"
    meta["ImageComments"] = "MASC zero-filled" if zero_filled else "MASC MAR-corrected"
    image.attribute_string = meta.serialize()
    return image


class ModelCache:
    """Engines' models loaded once per (checkpoint, device) and shared between connections."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mar: dict[tuple[str, str], Any] = {}
        self._masc: dict[tuple[str, str], Any] = {}

    def masc(self, checkpoint: str, device: str):
        """(LearnedPolicy, its MAR network or None) of a MASC checkpoint."""
        if not checkpoint:
            raise ConfigError("the masc policy needs a trained checkpoint: set policy_checkpoint")
        from masc_gadget.acquisition.learned import load_masc

        key = (checkpoint, device)
        with self._lock:
            if key not in self._masc:
                policy, mar, _ = load_masc(checkpoint, device)
                self._masc[key] = (policy, mar)
                log.info("loaded MASC policy %s on %s", checkpoint, device)
            return self._masc[key]

    def mar(self, checkpoint: str, device: str):
        if not checkpoint:
            return None
        from masc_gadget.models.checkpoint import load_mar

        key = (checkpoint, device)
        with self._lock:
            if key not in self._mar:
                self._mar[key] = load_mar(checkpoint, device)[0]
                log.info("loaded MAR network %s on %s", checkpoint, device)
            return self._mar[key]


DEFAULT_CACHE = ModelCache()


def process(items: Iterable[Any], header: Any, settings: GadgetSettings, send: Callable[[Any], None],
            on_error: Callable[[str], None] | None = None, cache: ModelCache = DEFAULT_CACHE) -> dict[str, int]:
    """The gadget loop, transport-free: ``items`` yields acquisitions (and, from a standalone
    client, JSON parameter strings before the first acquisition); ``send`` delivers images and
    in-band feedback. Bad acquisitions are reported through ``on_error`` and skipped; nothing
    already acquired is lost. Returns counters."""
    geometry = encoding_geometry(header)
    engine: AcquisitionEngine | None = None
    zmq_out: ZmqFeedback | None = None
    templates: dict[int, ismrmrd.AcquisitionHeader] = {}
    stats = {"acquisitions": 0, "decisions": 0, "images": 0, "rejected": 0}

    def report(message: str) -> None:
        log.warning("%s", message)
        if on_error is not None:
            on_error(message)

    def emit(result: SliceResult) -> None:
        template = templates.get(result.slice)
        send(make_image(result, template, header, series=1))
        stats["images"] += 1
        if settings.return_zero_filled:
            send(make_image(result, template, header, series=2, zero_filled=True))

    try:
        for item in items:
            if isinstance(item, str):
                if engine is not None:
                    report("parameters text after the first acquisition is ignored")
                    continue
                settings = settings_from_json(item, settings)
                log.info("parameters: %s", json.dumps(to_dict(settings)))
                continue
            if not isinstance(item, ismrmrd.Acquisition):
                log.debug("ignoring %s", type(item).__name__)
                continue
            acq = item
            if is_feedback(acq) or any(acq.is_flag_set(f) for f in _SKIP_FLAGS):
                continue
            if engine is None:
                policy = None
                mar = cache.mar(settings.mar_checkpoint, settings.device)
                if settings.policy == "masc":
                    policy, masc_mar = cache.masc(settings.policy_checkpoint, settings.device)
                    if mar is None:
                        mar = masc_mar
                engine = AcquisitionEngine(
                    EngineSettings(n_pe=geometry.n_pe, n_readout=geometry.n_readout, initial=settings.initial,
                                   budget=settings.budget, policy=settings.policy,
                                   mar_checkpoint=settings.mar_checkpoint, device=settings.device,
                                   seed=settings.seed, return_zero_filled=settings.return_zero_filled),
                    policy=policy,
                    mar=mar,
                )
                if settings.zmq_address:
                    zmq_out = ZmqFeedback(settings.zmq_address)
                # a slice is finished by the scanner (ACQ_LAST_IN_SLICE); in closed loop also when
                # its budget is spent. Open loop (no feedback asked for), the client decides what
                # it acquires, so the image waits for its last line or the close and uses them all.
                closed_loop = settings.feedback == "inband" or bool(settings.zmq_address)
            slice_index = int(acq.idx.slice)
            line = int(acq.idx.kspace_encode_step_1)
            data = acq.data
            if data.ndim != 2 or data.shape[0] != 1:
                stats["rejected"] += 1
                report(f"slice {slice_index} line {line}: acquisition has {data.shape[0]} channels; "
                       "MASC expects coil-combined single-channel data")
                continue
            if data.shape[1] != geometry.n_readout:
                stats["rejected"] += 1
                report(f"slice {slice_index} line {line}: {data.shape[1]} samples, but the header's "
                       f"encoded matrix has {geometry.n_readout} readout samples")
                continue
            try:
                decisions = engine.on_line(slice_index, line, data[0])
            except ValueError as err:
                stats["rejected"] += 1
                report(str(err))
                continue
            stats["acquisitions"] += 1
            templates.setdefault(slice_index, acq.getHead())
            for decision in decisions:
                stats["decisions"] += 1
                if settings.feedback == "inband":
                    send(feedback_acquisition(decision, acq.getHead()))
                if zmq_out is not None:
                    zmq_out.send(decision)
            if acq.is_flag_set(ismrmrd.ACQ_LAST_IN_SLICE) or (closed_loop and engine.complete(slice_index)):
                emit(engine.finish_slice(slice_index))
        if engine is not None:
            for slice_index in engine.slices():
                emit(engine.finish_slice(slice_index))
    finally:
        if zmq_out is not None:
            zmq_out.close()
    return stats


def masc(connection, settings: GadgetSettings | None = None) -> None:
    """Gadgetron external-module entry point: ``connection`` is a
    ``gadgetron.external.Connection`` (config, header, iterable of items, ``send``)."""
    base = settings or GadgetSettings()
    settings = settings_from_xml(getattr(connection, "config", None), base)
    log.info("MASC gadget %s: policy %s, %d + %d lines, MAR %s, feedback %s%s", __version__, settings.policy,
             settings.initial, settings.budget, settings.mar_checkpoint or "off", settings.feedback,
             f", zmq {settings.zmq_address}" if settings.zmq_address else "")
    stats = process(iter(connection), connection.header, settings, connection.send)
    log.info("MASC gadget done: %s", stats)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - debugging entry
    import sys

    from gadgetron.external import listen

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m masc_gadget.serving.gadget PORT", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    listen(int(argv[0]), masc)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
