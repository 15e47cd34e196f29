"""The gadget loop as small generator stages, each ``(iterable, context) -> iterable``, the way
gadgetron-python's examples are written::

    items -> parameters -> imaging_lines -> well_formed -> decide -> images -> send_all

Stages pull lazily, so each acquisition runs through the whole chain (decisions and images
sent) before the next item is read. What the stages share — the settings, the engine, the
templates of the images, the counters, where errors go — is the :class:`Context` of the
connection. :func:`process` chains them; the Gadgetron entry point
``masc(connection)`` and the standalone server both run ``process``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ismrmrd
import numpy as np

from masc_gadget import __version__
from masc_gadget.acquisition.engine import AcquisitionEngine, SliceResult
from masc_gadget.core.readout import oversampling_output, place_readout, remove_oversampling
from masc_gadget.config import ConfigError
from masc_gadget.mrd.feedback import fire_feedback, ZmqFeedback, feedback_acquisition, is_feedback
from masc_gadget.mrd.header import (EncodingGeometry, encoding_geometry, is_imaging_line, receiver_channels,
                                    slice_limit)
from masc_gadget.serving.host import Host, Reservation, size_text
from masc_gadget.serving.metrics import served_kind
from masc_gadget.serving.models import build_engine
from masc_gadget.serving.settings import GadgetSettings, settings_from_json

log = logging.getLogger(__name__)

__all__ = ["Context", "STAGES", "active_channels", "decide", "imaging_lines", "images", "make_image", "parameters",
           "pipeline", "process", "send_all", "well_formed"]


MAX_QUEUED_SLICES = 2
"""Finished slices a connection's image worker may hold before the reader waits for it
(back-pressure: a client that ends slices faster than their images are made is slowed down,
and the slices it holds stay counted in its reservation)."""


def _new_stats() -> dict[str, int]:
    return {"acquisitions": 0, "decisions": 0, "images": 0, "rejected": 0}


@dataclass(eq=False)
class Context:
    """One connection's state, shared by its stages."""

    header: Any
    """The parsed ISMRMRD header (``ismrmrd.xsd.ismrmrdHeader``)."""
    settings: GadgetSettings
    """Replaced by JSON parameters that come before the first acquisition."""
    send_item: Callable[[Any], None]
    """Delivers images and in-band feedback to the client."""
    on_error: Callable[[str], None] | None = None
    """Also told about every rejected or ignored item (besides the log)."""
    on_warning: Callable[[str], None] | None = None
    """Also told about every client setting not applied (besides the log)."""
    host: Host = field(default_factory=Host)
    """What the process serving this stream holds (:class:`~masc_gadget.serving.host.Host`):
    its limits, memory budget, model cache, decision batcher, side-channel allow-list."""
    trusted: GadgetSettings | None = None
    """The operator's settings: their checkpoints and ZeroMQ address may be anything; a value
    the connection changes (JSON parameters) must be a model name the server offers and an
    allowed endpoint (:func:`masc_gadget.serving.models.load_models`,
    :func:`masc_gadget.mrd.feedback.endpoint_allowed`). Default: ``settings`` as given."""
    geometry: EncodingGeometry = field(init=False)
    engine: AcquisitionEngine | None = None
    """Built at the first well-formed imaging acquisition (:func:`well_formed`)."""
    zmq_out: ZmqFeedback | None = None
    closed_loop: bool = False
    """In-band feedback was asked for: the client acquires what the gadget decides, so a slice
    is also finished once its budget is spent (:meth:`finishes`)."""
    reservation: Reservation = field(init=False)
    """What this scan holds of the host's memory budget: each open slice's k-space from its
    first line, and each finished one's until its image is made (:meth:`open_slice`)."""
    gone: bool = False
    """The client can no longer be sent to (a send failed): nothing more is computed for it."""
    hurry: threading.Event = field(default_factory=threading.Event)
    """Set when there is no time left for the network (a shutdown past 40 % of its
    ``server.shutdown_s``): the slices still to finish are served zero-filled, named so."""
    background_images: bool = False
    """Reconstruct and send finished slices on a worker thread of this connection, so that the
    next slice's decisions do not wait for the previous slice's final MAR image (the stream
    must take sends from two threads: :class:`~masc_gadget.mrd.protocol.MrdStream` does)."""
    _worker: Any = field(default=None, init=False, repr=False)
    _pending: list = field(default_factory=list, init=False, repr=False)
    coils: tuple[int, ...] = ()
    """The receive channels of the scan: those of its first imaging acquisition
    (:func:`active_channels`); every later line must carry them."""
    mask_warned: bool = False
    """A channel_mask that disagrees with the data was logged (once per connection)."""
    templates: dict[int, ismrmrd.AcquisitionHeader] = field(default_factory=dict)
    """Per slice, the header of its centre line (grid row ``n_pe // 2``), else of its first
    stored line: the position and orientation of its image."""
    stats: dict[str, int] = field(default_factory=_new_stats)

    def __post_init__(self) -> None:
        self.geometry = encoding_geometry(self.header)
        if self.trusted is None:
            self.trusted = self.settings
        self.reservation = self.host.reservation()

    def send(self, item: Any) -> None:
        """Deliver an item to the client; a failed send marks the client gone (:attr:`gone`)."""
        try:
            self.send_item(item)
        except OSError:
            self.gone = True
            raise

    def report(self, message: str) -> None:
        log.warning("%s", message)
        if self.on_error is not None:
            self.on_error(message)

    def reject(self, message: str, reason: str = "line") -> None:
        """An acquisition is skipped: counted (``reason``: one of
        :data:`~masc_gadget.serving.metrics.REJECTIONS`), logged and reported."""
        self.stats["rejected"] += 1
        self.host.metrics.rejected(reason)
        self.report(message)

    def start(self, first: ismrmrd.Acquisition | None = None) -> None:
        """The side channel and the engine (models loaded through the cache) of the settings,
        for the channels of the ``first`` imaging acquisition (without it: the header's
        ``receiverChannels``, or one). ValueError for channels beyond the header's
        ``receiverChannels`` (that line is rejected, and the next one may start the scan);
        ConfigError, which ends the scan, for an endpoint not allowed, a model not offered,
        or a k-space over the host's limits."""
        s = self.settings
        limit = receiver_channels(self.header)
        coils = tuple(range(limit or 1)) if first is None else active_channels(first)
        if not coils:
            raise ValueError("the acquisition carries no receive channel (active_channels 0)")
        if limit is not None and max(coils) >= limit:
            raise ValueError(f"the acquisition uses channel {max(coils)}, but the header has "
                             f"{limit} receiver channel(s)")
        self._check_slice_size(len(coils))
        self.coils = coils
        try:
            if s.zmq_address:
                operator = s.zmq_address == self.trusted.zmq_address
                self.host.check_side_channel(s.zmq_address)
                allowed = (*self.host.zmq_allow, s.zmq_address) if operator else self.host.zmq_allow
                self.zmq_out = ZmqFeedback(s.zmq_address, allowed=allowed)
            self.engine = build_engine(s, self.geometry.n_pe, self.geometry.grid_readout, self.host.cache,
                                       trusted=self.trusted, batcher=self.host.batcher, n_coils=len(coils),
                                       rows=self.geometry.acquirable_rows, warmed=self.host.warmed)
        except ValueError as err:  # the scan cannot run at all: not one line's fault
            raise ConfigError(str(err)) from None
        self.closed_loop = s.feedback in ("inband", "fire")
        self.host.metrics.scan_started()

    @property
    def slice_bytes(self) -> int:
        """Bytes of one slice's k-space: receive coils x matrix x 8 (complex64)."""
        return max(1, len(self.coils)) * self.geometry.n_pe * self.geometry.grid_readout * 8

    def _slice_text(self, n_coils: int) -> str:
        nbytes = n_coils * self.geometry.n_pe * self.geometry.grid_readout * 8
        return (f"{n_coils} coils x {self.geometry.n_pe} x {self.geometry.grid_readout} samples, "
                f"{size_text(nbytes)}")

    def _check_slice_size(self, n_coils: int) -> None:
        """ConfigError, before anything is allocated, when one slice of ``n_coils`` coils alone
        exceeds the per-scan limit or the whole budget (it could never be held)."""
        need = n_coils * self.geometry.n_pe * self.geometry.grid_readout * 8
        limits = self.host.limits
        if need > limits.max_kspace_bytes:
            raise ConfigError(f"one slice's k-space ({self._slice_text(n_coils)}) exceeds this server's limit of "
                              f"{size_text(limits.max_kspace_bytes)} per scan (server.max_kspace_bytes)")
        if need > self.host.budget.total:
            raise ConfigError(f"one slice's k-space ({self._slice_text(n_coils)}) exceeds this server's memory "
                              f"budget for all scans ({size_text(self.host.budget.total)}, "
                              "server.memory_budget_bytes)")

    def open_slice(self, slice_index: int) -> bool:
        """Count a slice's k-space in the reservation before its first line is stored; True
        when it was taken now (False: the slice is open already). ConfigError (nothing taken)
        when it does not fit the scan's limit or what is left of the host's budget."""
        if self.engine.holds(slice_index):
            return False
        self.reservation.take(self.slice_bytes, f"slice {slice_index}'s k-space ({self._slice_text(len(self.coils))})")
        return True

    def finishes(self, slice_index: int) -> bool:
        """Whether a slice is finished now, before the scanner's ``ACQ_LAST_IN_SLICE``: its
        budget is spent and the scanner follows the decisions: it asked for in-band feedback,
        or it takes them from the ZeroMQ side channel and every line after the initial ones
        was a decided line. Open loop (no feedback, or a ``zmq_address`` while the client
        streams its own order), the client decides what it acquires, so the image waits for
        its last line or the close and uses them all."""
        engine = self.engine
        if not engine.complete(slice_index):
            return False
        return self.closed_loop or (self.zmq_out is not None and engine.followed(slice_index))

    def finish(self, slice_index: int) -> SliceResult | None:
        """Finish a slice: its result now, or (``background_images``) None, its buffers taken
        from the engine at once and its images reconstructed and sent by the worker, which
        holds at most :data:`MAX_QUEUED_SLICES` of them (the caller waits for it beyond that).
        The slice's k-space stays counted until its images are made."""
        if not self.background_images:
            try:
                return self.engine.finish_detached(self.engine.detach_slices([slice_index]), self._hurried())[0]
            finally:
                self.reservation.give(self.slice_bytes)
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masc-images")
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        while sum(not f.done() for f in self._pending) >= MAX_QUEUED_SLICES:
            next(f for f in self._pending if not f.done()).exception()  # wait for the oldest
        detached = self.engine.detach_slices([slice_index])
        self._pending.append(self._worker.submit(self._send_results, self.engine, detached))
        return None

    def _send_results(self, engine: AcquisitionEngine, detached: list) -> None:
        try:
            if not self.gone:  # nothing is computed for a client that has gone
                send_all(images(engine.finish_detached(detached, self._hurried()), self), self)
        finally:
            detached.clear()  # the k-space is freed here, then no longer counted
            self.reservation.give(self.slice_bytes)

    def _hurried(self) -> str:
        return "no time left for the network: the server is shutting down" if self.hurry.is_set() else ""

    def drain(self) -> None:
        """Wait for every slice the worker holds to be sent; re-raise the first failure."""
        pending, self._pending = self._pending, []
        error = None
        for future in pending:
            try:
                future.result()
            except Exception as err:  # noqa: BLE001 - the first one is raised below
                error = error or err
        if error is not None:
            raise error

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self.engine is not None:
            self.host.metrics.scan_ended()
        if self.zmq_out is not None:
            self.zmq_out.close()
        self.reservation.close()


def parameters(items: Iterable[Any], ctx: Context) -> Iterator[Any]:
    """Apply JSON parameter text (str items) that comes before the first acquisition to
    ``ctx.settings``; later text is reported and ignored. Everything else passes."""
    for item in items:
        if not isinstance(item, str):
            yield item
        elif ctx.engine is not None:
            ctx.report("parameters text after the first acquisition is ignored")
        else:
            notes: list[str] = []
            ctx.settings = settings_from_json(item, ctx.settings, ctx.host.limits.client_overrides, notes)
            for note in notes:  # refused: the operator's value stands (logged by client_values)
                if ctx.on_warning is not None:
                    ctx.on_warning(note)
            log.info("parameters: %s", json.dumps(ctx.settings.flat()))


def imaging_lines(items: Iterable[Any], ctx: Context) -> Iterator[ismrmrd.Acquisition]:
    """Only the acquisitions that carry imaging lines: no other item types, no feedback
    acquisitions, none flagged :data:`~masc_gadget.mrd.header.NOT_IMAGING`."""
    for item in items:
        if not isinstance(item, ismrmrd.Acquisition):
            log.debug("ignoring %s", type(item).__name__)
        elif is_imaging_line(item.flags) and not is_feedback(item):
            yield item


def channel_mask_bits(acq: ismrmrd.Acquisition) -> list[int]:
    """The channels whose bits are set in ``acq``'s ``channel_mask`` (16 words of 64 channels)."""
    words = np.asarray(acq.getHead().channel_mask, dtype=np.uint64)
    return [64 * w + b for w, word in enumerate(words.tolist()) for b in range(64) if (int(word) >> b) & 1]


def active_channels(acq: ismrmrd.Acquisition) -> tuple[int, ...]:
    """The receive channels whose samples ``acq`` carries, in the order of its data rows: the
    bits set in its ``channel_mask``, or channels 0 to ``rows - 1`` when no bit is set or when
    the mask names another number of channels than the data carry (scanners set masks that
    disagree with the data; the data settle it: :func:`channel_mask_mismatch` says so)."""
    bits = channel_mask_bits(acq)
    rows = int(acq.data.shape[0]) if acq.data.ndim == 2 else 1
    return tuple(bits) if bits and len(bits) == rows else tuple(range(rows))


def channel_mask_mismatch(acq: ismrmrd.Acquisition) -> str | None:
    """Why ``acq``'s channel_mask is not used (it names another number of channels than the
    data rows), or None."""
    bits = channel_mask_bits(acq)
    rows = int(acq.data.shape[0]) if acq.data.ndim == 2 else 1
    if bits and len(bits) != rows:
        return (f"channel_mask names {len(bits)} channel(s) but the acquisitions carry {rows}: "
                f"the data's {rows} channel(s) are used, in row order")
    return None


class GridLine(NamedTuple):
    """An acquisition on the reconstruction grid (:func:`well_formed`)."""

    acq: ismrmrd.Acquisition
    slice: int
    row: int
    """Grid row: ``kspace_encode_step_1`` + the header's PE offset (:attr:`EncodingGeometry.pe_offset`)."""
    samples: np.ndarray
    """(coils, grid readout) complex64, the scan's channels in order, readout oversampling
    removed and the line placed on the grid by its ``center_sample``."""


def to_grid(acq: ismrmrd.Acquisition, samples: np.ndarray, geometry: EncodingGeometry) -> tuple[int, np.ndarray]:
    """(grid row, (coils, grid readout) samples) of an imaging line, as Gadgetron's Cartesian chain
    places it: readout oversampling removed (:func:`masc_gadget.core.readout.remove_oversampling`,
    ``center_sample`` scaled with it), the line placed by its ``center_sample``
    (:func:`~masc_gadget.core.readout.place_readout`: asymmetric echoes zero-filled), the row
    shifted so the header's centre line lands on ``n_pe // 2``. ValueError naming what does not fit."""
    head = acq.getHead()
    center = int(head.center_sample)
    if geometry.removes_oversampling:
        n_out = oversampling_output(samples.shape[1], geometry.fov_mm[0], geometry.image_fov_mm[0])
        samples = remove_oversampling(samples, max(n_out, 1))
        center = int(center / geometry.readout_ratio)
    samples = place_readout(samples, geometry.grid_readout, center)
    line = int(acq.idx.kspace_encode_step_1)
    row = line + geometry.pe_offset
    if not 0 <= row < geometry.n_pe:
        raise ValueError(f"kspace_encode_step_1 {line} is outside the encoded matrix of {geometry.n_pe} lines "
                         f"(centre line {geometry.pe_centre})")
    return row, samples


def well_formed(acqs: Iterable[ismrmrd.Acquisition], ctx: Context) -> Iterator[GridLine]:
    """Reject (``ctx.reject``) acquisitions beyond the header's slice limit (a stream cannot grow
    without bound), with no receive channel, whose readout is longer than the header's encoded
    matrix or does not fit the grid (:func:`to_grid`), or that do not carry the scan's channels
    (``ctx.coils``; a line with more gives the scan's). The first line that passes starts the
    engine (:meth:`Context.start`) for its channels: a rejected line never fixes the scan's
    coil set. Yields each line on the reconstruction grid (:class:`GridLine`)."""
    n_readout = ctx.geometry.n_readout
    n_slices = slice_limit(ctx.header)
    for acq in acqs:
        slice_index, line = int(acq.idx.slice), int(acq.idx.kspace_encode_step_1)
        data = acq.data
        if n_slices is not None and slice_index >= n_slices:
            ctx.reject(f"slice {slice_index} line {line}: beyond the header's slice limit "
                       f"({n_slices} slices)", "slice_limit")
            continue
        if data.ndim != 2 or data.shape[0] == 0:
            ctx.reject(f"slice {slice_index} line {line}: the acquisition carries no receive channel "
                       "(active_channels 0)", "no_channel")
            continue
        if not 1 <= data.shape[1] <= n_readout:
            ctx.reject(f"slice {slice_index} line {line}: {data.shape[-1]} samples, but the header's "
                       f"encoded matrix has {n_readout} readout samples", "samples")
            continue
        channels = active_channels(acq)
        if not ctx.mask_warned:
            mismatch = channel_mask_mismatch(acq)
            if mismatch is not None:
                ctx.mask_warned = True
                log.warning("slice %d line %d: %s (said once per connection)", slice_index, line, mismatch)
        coils = ctx.coils if ctx.engine is not None else channels
        where = {c: i for i, c in enumerate(channels)}
        missing = [c for c in coils if c not in where]
        if missing:
            ctx.reject(f"slice {slice_index} line {line}: the acquisition carries channels {list(channels)[:16]}, "
                       f"without {missing[:16]} that the scan's first line had ({len(coils)} coils)", "channels")
            continue
        rows = [where[c] for c in coils]
        samples = data if rows == list(range(data.shape[0])) else data[rows]
        try:
            row, samples = to_grid(acq, samples, ctx.geometry)
            if ctx.engine is None:
                ctx.start(acq)
        except ConfigError:  # the scan cannot run: ends the stream with its reason
            raise
        except ValueError as err:
            ctx.reject(f"slice {slice_index} line {line}: {err}", "grid")
            continue
        yield GridLine(acq, slice_index, row, samples)


def decide(lines: Iterable[GridLine], ctx: Context) -> Iterator[SliceResult]:
    """Feed each line to the engine, send its decisions (in-band and / or ZeroMQ, in the
    scanner's line numbering) and yield the slices that are finished: by the scanner
    (``ACQ_LAST_IN_SLICE``), in closed loop once their budget is spent
    (:meth:`Context.finishes`), and every slice still held when the stream ends."""
    offset = ctx.geometry.pe_offset
    refused = None
    for acq, slice_index, row, samples in lines:
        engine = ctx.engine
        opened = False
        try:
            opened = ctx.open_slice(slice_index)
            started = time.perf_counter()
            decisions = engine.on_line(slice_index, row, samples)
            ctx.host.metrics.decided(len(decisions), time.perf_counter() - started)
        except ConfigError as err:  # no room for a new slice: serve the open ones, then say why
            ctx.host.metrics.rejected("memory")
            refused = err
            break
        except ValueError as err:
            if opened and not engine.holds(slice_index):
                ctx.reservation.give(ctx.slice_bytes)
            ctx.reject(str(err))
            continue
        ctx.stats["acquisitions"] += 1
        if slice_index not in ctx.templates or row == ctx.geometry.n_pe // 2:
            ctx.templates[slice_index] = acq.getHead()  # the centre line's geometry, as Gadgetron's
        for decision in decisions:
            if offset:
                decision = dataclasses.replace(decision, line=decision.line - offset)
            ctx.stats["decisions"] += 1
            if ctx.settings.feedback == "inband":
                ctx.send(feedback_acquisition(decision, acq.getHead()))
            elif ctx.settings.feedback == "fire":
                ctx.send(fire_feedback(decision))
            if ctx.zmq_out is not None:
                ctx.zmq_out.send(decision)
        if acq.is_flag_set(ismrmrd.ACQ_LAST_IN_SLICE) or ctx.finishes(slice_index):
            result = ctx.finish(slice_index)
            if result is not None:
                yield result
    if ctx.engine is not None:
        for slice_index in ctx.engine.slices():
            result = ctx.finish(slice_index)
            if result is not None:
                yield result
    if refused is not None:
        raise refused


def images(results: Iterable[SliceResult], ctx: Context) -> Iterator[ismrmrd.Image]:
    """The ``ismrmrd.Image`` of each finished slice (series 1), and its zero-filled image
    (series 2) when ``return_zero_filled`` is set."""
    mar_loaded = ctx.engine is not None and ctx.engine.mar is not None
    for result in results:
        template = ctx.templates.get(result.slice)
        yield make_image(result, template, ctx.header, series=1)
        ctx.stats["images"] += 1
        ctx.host.metrics.image(served_kind(str(result.mar), mar_loaded))
        if ctx.settings.return_zero_filled:
            yield make_image(result, template, ctx.header, series=2, zero_filled=True)


def send_all(items: Iterable[Any], ctx: Context) -> None:
    """The end of the chain: deliver every item to the client."""
    for item in items:
        ctx.send(item)


STAGES = (parameters, imaging_lines, well_formed, decide, images)
"""The stages from the connection's items to its images, in order (then :func:`send_all`)."""


def pipeline(items: Iterable[Any], ctx: Context) -> Iterable[Any]:
    """``items`` through every stage of :data:`STAGES`: the images to send."""
    for stage in STAGES:
        items = stage(items, ctx)
    return items


def process(items: Iterable[Any], header: Any, settings: GadgetSettings, send: Callable[[Any], None],
            on_error: Callable[[str], None] | None = None, *, host: Host | None = None,
            trusted: GadgetSettings | None = None, eager: bool = False,
            background_images: bool = False, on_warning: Callable[[str], None] | None = None,
            hurry: threading.Event | None = None) -> dict[str, int]:
    """The gadget loop, transport-free: ``items`` yields acquisitions (and, from a standalone
    client, JSON parameter strings before the first acquisition); ``send`` delivers images and
    in-band feedback. Bad acquisitions are reported through ``on_error`` and skipped;
    nothing already acquired is lost. Runs :data:`STAGES`.

    ``host``: what the serving process holds (limits, memory budget, model cache, decision
    batcher, side-channel allow-list; default: a :class:`~masc_gadget.serving.host.Host` with
    the defaults). ``trusted``: the operator's settings (default: ``settings`` itself);
    checkpoints that the connection names differently must be names the server offers
    (:func:`masc_gadget.serving.models.load_models`). ``eager``: build and warm up the engine
    now, from the header, instead of at the first acquisition (for streams whose settings
    cannot change later, as through Gadgetron, which drops the client's text messages).
    ``background_images``: finished slices are reconstructed and sent on a worker thread
    (``send`` must be thread-safe), all of them before this returns (:attr:`Context.background_images`).

    ``hurry``: set by the caller when there is no time left for the network (a shutdown): the
    slices still to finish are served zero-filled (:attr:`Context.hurry`).

    ``on_warning``: told what the stream did not apply (a client's setting the operator did not
    allow, :func:`masc_gadget.serving.settings.client_values`).

    Returns counters (acquisitions, decisions, images, rejected)."""
    ctx = Context(header, settings, send, on_error=on_error, host=host or Host(), trusted=trusted,
                  background_images=background_images, on_warning=on_warning,
                  hurry=threading.Event() if hurry is None else hurry)
    try:
        if eager:
            ctx.start()
        send_all(pipeline(items, ctx), ctx)
        ctx.drain()
    finally:
        ctx.close()
    return ctx.stats


_MAX_META_TEXT = 128


def _meta_text(value: Any) -> str:
    """A meta string every ISMRMRD parser takes: printable ASCII (others become ``?``; XML
    escapes ``<``, ``&``...), at most 128 characters, never empty ("none")."""
    text = "".join(c if " " <= c <= "~" else "?" for c in str(value)).strip()
    return text[:_MAX_META_TEXT] or "none"


def _meta(result: SliceResult, zero_filled: bool, pe_offset: int = 0) -> ismrmrd.Meta:
    """The image's meta attributes; each written with at least one value (see make_image).
    Lines in the scanner's numbering (``kspace_encode_step_1``: grid row - ``pe_offset``)."""
    meta = ismrmrd.Meta()
    for key, values in (("MASC.lines", result.lines), ("MASC.decided", result.decided)):
        if len(values):
            meta[key] = [int(v) - pe_offset for v in values]
    meta["MASC.policy"] = _meta_text(result.policy)
    meta["MASC.mar"] = "none (zero-filled)" if zero_filled else _meta_text(result.mar)
    if not zero_filled and math.isfinite(result.ood_score):
        meta["MASC.ood_score"] = f"{result.ood_score:.4g}"
    meta["MASC.version"] = _meta_text(__version__)
    meta["DataRole"] = "Image"
    if zero_filled:
        meta["ImageComments"] = "MASC zero-filled"
    elif str(result.mar).startswith("none"):  # the MAR series served zero-filled: say so where viewers look
        meta["ImageComments"] = _meta_text(f"MASC zero-filled, MAR fallback: {str(result.mar)[len('none'):].strip(' ()')}")
    else:
        meta["ImageComments"] = "MASC MAR-corrected"
    return meta


def make_image(result: SliceResult, template: ismrmrd.AcquisitionHeader | None, header: Any,
               series: int, zero_filled: bool = False) -> ismrmrd.Image:
    """The finished slice as an ``ismrmrd.Image`` (magnitude, float32, (y, x) = (PE, RO)) with
    meta attributes listing the acquired lines, the policy and the versions.

    Pixels: the engine's served images (:func:`masc_gadget.core.served.served_images`, clamped
    at 0 as a magnitude, the image tagged ``IMTYPE_MAGNITUDE``), unchanged. Meta attributes: every one
    written has at least one ``<value>`` (Gadgetron's C++ parser rejects a ``<meta>`` without
    one and ends the stream): ``MASC.lines`` (acquired lines, arrival order) and
    ``MASC.decided`` (those the gadget had asked for) are left out when empty, e.g.
    ``MASC.decided`` of an open-loop slice; ``MASC.policy`` and ``MASC.mar`` are printable
    ASCII of at most 128 characters.
    """
    geometry = encoding_geometry(header)
    data = np.ascontiguousarray(result.zero_filled if zero_filled else result.image, dtype=np.float32)
    data, fov = _recon_rows(data, geometry)
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
    image.field_of_view = fov
    image.attribute_string = _meta(result, zero_filled, geometry.pe_offset).serialize()
    return image


def _recon_rows(data: np.ndarray, geometry: EncodingGeometry) -> tuple[np.ndarray, tuple[float, float, float]]:
    """The (y, x) pixels and field of view (x, y, z mm) an image is returned with. The grid's
    readout is the recon space's already (:func:`to_grid`); along the phase encoding, a recon
    space that keeps the centre ``recon_pe`` of ``n_pe`` lines over a narrower field of view
    (phase oversampling) is cut out of the image's centre rows; otherwise every encoded row is
    returned (as Gadgetron's ``default.xml`` does), with the field of view those rows cover."""
    x_fov, y_fov, z_fov = geometry.image_fov_mm
    n_pe = data.shape[0]
    recon_pe = geometry.recon_pe or n_pe
    if recon_pe < n_pe and y_fov < geometry.fov_mm[1]:
        top = (n_pe - recon_pe) // 2
        return np.ascontiguousarray(data[top:top + recon_pe]), (x_fov, y_fov, z_fov)
    if recon_pe != n_pe:  # the rows cover the encoded field of view
        y_fov = geometry.fov_mm[1]
    return data, (x_fov, y_fov, z_fov)
