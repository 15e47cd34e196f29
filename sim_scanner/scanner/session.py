"""The simulated scanner: replays a paired dataset over the MRD wire protocol and obeys the
gadget's next-line decisions under a deadline (DESIGN.md, "Simulated scanner").

For each subject file the scanner connects to a gadget (``masc serve`` or Gadgetron), sends
config by name (id 1), the ``metal`` group's ISMRMRD header (3) and a JSON text (5) with its
parameters (feedback mode, ZeroMQ address, initial, budget, policy), then acquires:

* the ``initial`` centre lines of a slice (:func:`masc_gadget.acquisition.episode.initial_lines`), then
  ``budget`` lines one at a time. Sequential: slice after slice. Interleaved (``interleave``):
  the initial lines of every slice first, then round-robin over slices, one line each, as a
  multi-slice TSE;
* before each chosen line it waits for the decision for (slice, step) until ``deadline_ms``
  after it sent the previous line of that slice. ``step`` is the number of lines of the slice
  acquired after its initial ones. A decision is taken when its line is in range and not yet
  acquired; otherwise (a miss, an invalid line, a silent or dead gadget) the scanner takes the
  line the deterministic ``fallback`` policy chooses on its current mask, which never repeats a
  line. Every slice therefore always gets exactly ``initial + budget`` lines;
* ``feedback = "none"`` is open loop (a plain MRD client): the initial lines and the fallback
  order are streamed without waiting (with ``order``: those lines in a scanner's order,
  linear, reverse, centric or interleaved).

On request the lines go out as a scanner records them (``readout_oversampling``, ``coils``,
``noise``, ``asymmetric_echo``, ``channel_mask``: :mod:`sim_scanner.dataset.streams`), with the
header that describes them; the scanner's own bookkeeping and zero-filled images stay on the
simulator's grid.

The scanner is the authority on what was acquired: it keeps its own k-space of every line it
acquired, so when the gadget dies mid-scan it finishes on the fallback order (sending nothing)
and scores its own zero-filled reconstruction for slices that got no image back.

Results: :class:`~sim_scanner.scanner.report.ScanReport` (``OUTDIR/report.json``) and the returned images
(``OUTDIR/images.h5``, one ISMRMRD group per subject: ``<subject>/images`` as returned by the
gadget, ``<subject>/scanner_zero_filled`` for slices without a returned image).

Time stamps: ``acquisition_time_stamp`` (2.5 ms ticks) starts at the time of day when the
subject's scan starts and advances by the sequence's nominal line period
(:func:`sim_scanner.dataset.mrd_hdf5.line_period_ms`), strictly increasing. With ``pace`` the lines
also go out at that period in real time (``line_period_ms`` replaces it), as a scanner plays
them; without it, as fast as the decisions come, and only the deadlines are real time.

Modules: :mod:`~sim_scanner.scanner.config` (``ScannerConfig``, names), :mod:`~sim_scanner.scanner.link`
(the gadget connection and the decisions it delivers), :mod:`~sim_scanner.scanner.report` (what
is reported), :mod:`~sim_scanner.scanner.returned` (the images that came back, scored and
written) and this one (the scan itself). Subject files are read through
:mod:`sim_scanner.dataset.layout`; the scanner imports nothing of the simulator.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ismrmrd
import numpy as np

from masc_gadget.acquisition.episode import AcquisitionConfig, EpisodeBatch
from masc_gadget.acquisition.policies import SamplingPolicy, make_policy, run_episode, select_next
from masc_gadget.config import Config, to_dict
from masc_gadget.mrd.header import flag_mask
from sim_scanner.dataset import mrd_hdf5 as mrd
from sim_scanner.dataset.streams import (StreamStyle, field_of_view_mm, line_order, styled_acquisition, styled_header,
                                         styled_kspace)
from sim_scanner.dataset.layout import (
    ScanInput,
    read_manifest,
    read_scan_input,
    split_subjects,
    subject_path,
    subject_slices,
)
from sim_scanner.scanner.config import (
    FIGURE_FILE,
    IMAGES_FILE,
    REASON_DISCONNECTED,
    REASON_INVALID,
    REASON_MISS,
    REASON_OPEN_LOOP,
    REPORT_FILE,
    SOURCE_FALLBACK,
    SOURCE_GADGET,
    SOURCE_INITIAL,
    ScannerConfig,
)
from sim_scanner.scanner.link import DecisionBoard, GadgetLink, ZmqPump
from sim_scanner.scanner.report import ScanReport, SliceReport, SubjectReport, log_subject, scan_totals
from sim_scanner.scanner.returned import collect_images, score_slices, write_images

log = logging.getLogger(__name__)

_F_FIRST_IN_SLICE = flag_mask(ismrmrd.ACQ_FIRST_IN_SLICE)
_F_LAST_IN_SLICE = flag_mask(ismrmrd.ACQ_LAST_IN_SLICE)
_F_LAST_IN_MEASUREMENT = flag_mask(ismrmrd.ACQ_LAST_IN_MEASUREMENT)


# ------------------------------------------------------------------------------------- scanning


@dataclass
class _SliceState:
    """Scanner-side bookkeeping of one slice during the scan (its episode, the lines acquired,
    is row ``report.slice`` of the subject's :class:`EpisodeBatch`)."""

    report: SliceReport
    last_sent: float = 0.0


PACE_JITTER_MS = 5.0
"""A paced line that goes out this late or less is on time (a client's scheduling jitter)."""


def _ticks_since_midnight() -> int:
    now = datetime.now()
    seconds = now.hour * 3600 + now.minute * 60 + now.second + now.microsecond / 1e6
    return int(seconds * 1000 / mrd.TIMESTAMP_TICK_MS)


def _schedule(
    n_slices: int, initial: int, budget: int, interleave: bool, train: int = 1
) -> list[tuple[int, bool]]:
    """(slice, is_initial) per acquired line, in acquisition order; interleaved, the slices
    take turns by echo trains of ``train`` lines (the last one may be shorter)."""
    if not interleave:
        return [
            (s, k < initial) for s in range(n_slices) for k in range(initial + budget)
        ]
    order = [(s, True) for s in range(n_slices) for _ in range(initial)]
    for start in range(0, budget, train):
        order += [(s, False) for s in range(n_slices) for _ in range(min(train, budget - start))]
    return order


def _fov_mm(header_xml: str) -> float:
    """The recon space's field of view along the readout in mm, 0 when the header does not say."""
    try:
        return float(ismrmrd.xsd.CreateFromDocument(header_xml).encoding[0].reconSpace.fieldOfView_mm.x)
    except Exception:  # noqa: BLE001 - a header without a recon space: no scale bar
        return 0.0


def gadget_parameters(
    scfg: ScannerConfig, acq: AcquisitionConfig, pump: ZmqPump | None = None
) -> dict[str, Any]:
    """The JSON parameters (text message, id 5) sent after the header.

    ``feedback`` is the gadget's switch for decisions on the MRD connection: "inband" or "fire"
    (message 1028) in those modes. With the side channel it is "none" and ``zmq_address`` is the
    endpoint the scanner bound (otherwise "", so that the gadget pushes to no one); ``initial``
    and ``budget``, the protocol the scanner plays (a server serving another ends the connection
    with an error naming both); ``policy`` only when ``scanner.policy`` asks for one (the server
    serves its operator's otherwise, and applies a client's only where its operator allows it);
    ``token`` only when ``scanner.token`` is set.
    """
    params = {
        "feedback": scfg.feedback if scfg.feedback in ("inband", "fire") else "none",
        "zmq_address": pump.endpoint if pump is not None else "",
        "initial": acq.initial,
        "budget": acq.budget,
    }
    if scfg.policy:  # asked for explicitly (masc scan --policy): the server's own otherwise
        params["policy"] = scfg.policy
    if acq.lines_per_decision != 1:  # an echo train per decision (older gadgets never see the key)
        params["lines_per_decision"] = acq.lines_per_decision
    if scfg.token:
        params["token"] = scfg.token
    return params


@dataclass
class _Subject:
    """One subject's scan in progress: what is replayed, where each slice stands, the link."""

    data: ScanInput
    scfg: ScannerConfig
    acq: AcquisitionConfig
    report: SubjectReport
    episodes: EpisodeBatch
    """Every line the scanner acquires, initial ones included, whoever chose it."""
    states: list[_SliceState]
    board: DecisionBoard
    fallback: SamplingPolicy
    acquired: np.ndarray
    """(n_slices, n_coils, n_pe, n_readout) the k-space the scanner acquired (zero elsewhere)."""
    link: GadgetLink | None = None
    start_ticks: int = 0
    timestamp: int = -1
    planned: list[int] | None = None
    """Open loop with ``scanner.order``: every slice's lines in the order they are sent."""
    initial_set: frozenset[int] = frozenset()
    style: StreamStyle | None = None
    """How lines are recorded (ScannerConfig's stream fields); None: as simulated."""
    sent: np.ndarray | None = None
    """(n_slices, coils, n_pe, n_samples) the k-space as the receive array records it, with
    ``style``; None without a style."""

    def choose(self, counter: int, s: int, is_initial: bool) -> tuple[int, str]:
        """The line slice ``s`` acquires at scan counter ``counter`` and where it came from."""
        link, report = self.link, self.report
        connected = link is not None and link.alive
        if link is not None and not connected and report.connection_lost_at is None:
            report.connection_lost_at = counter
        if self.planned is not None:  # open loop in a scanner's order
            line = self.planned[int(self.episodes.n_acquired[s])]
            if line in self.initial_set:
                return line, SOURCE_INITIAL
            _record_step(self.states[s].report, REASON_OPEN_LOOP)
            return line, SOURCE_FALLBACK
        if is_initial:
            return int(self.episodes.initial_lines[self.episodes.n_acquired[s]]), SOURCE_INITIAL
        st = self.states[s]
        line, source = _next_line(st, self.episodes, self.scfg, self.fallback, self.board,
                                  connected, self.scfg.deadline_ms / 1e3)
        if link is not None and not link.alive and st.report.fallback_reasons[-1] == REASON_MISS:
            # the wait ended because the connection died, not the deadline
            st.report.fallback_reasons[-1] = REASON_DISCONNECTED
            st.report.misses -= 1
            if report.connection_lost_at is None:
                report.connection_lost_at = counter
        return line, source

    def acquire(self, counter: int, n_lines: int, period_ticks: float, s: int, line: int,
                source: str) -> None:
        """Send line ``line`` of slice ``s`` (scan counter ``counter`` of ``n_lines``) and
        record it as acquired."""
        data, count = self.data, int(self.episodes.n_acquired[s])
        flags = 0
        if count == 0:
            flags |= _F_FIRST_IN_SLICE
        if count == self.acq.total - 1:
            flags |= _F_LAST_IN_SLICE
        if counter == n_lines - 1:
            flags |= _F_LAST_IN_MEASUREMENT
        self.timestamp = max(self.start_ticks + round(counter * period_ticks), self.timestamp + 1)
        if data.templates is not None:  # a recorded scan: its own header for the line, as recorded
            acquisition = _recorded(data.templates[(s, line)], data.kspace[s, :, line], counter,
                                    self.timestamp % 2**32, flags)
        else:
            acquisition = None
        acquisition = acquisition or mrd.make_acquisition(
            data.kspace[s, :, line],
            line=line,
            slice_index=s,
            seq=data.seq,
            slice_centre_mm=data.slice_centres_mm[s],
            fov_centre_mm=data.fov_centre_mm,
            scan_counter=counter,
            timestamp=self.timestamp % 2**32,
            flags=flags,
            n_slices=data.kspace.shape[0],
        )
        if self.style is not None:
            acquisition = styled_acquisition(acquisition.getHead(), self.sent[s, :, line], self.style)
        st = self.states[s]
        st.last_sent = time.perf_counter()
        if self.link is not None:
            self.link.send_acquisition(acquisition)
        self.acquired[s, :, line] = data.kspace[s, :, line]
        self.episodes.record(s, line)
        st.report.lines.append(int(line))
        st.report.sources.append(source)


_SCAN_FLAGS = _F_FIRST_IN_SLICE | _F_LAST_IN_SLICE | _F_LAST_IN_MEASUREMENT


def _recorded(head: ismrmrd.AcquisitionHeader, samples: np.ndarray, counter: int, timestamp: int,
              flags: int) -> ismrmrd.Acquisition:
    """A recorded line sent again: its header as recorded, with the replay's scan counter, time
    stamp and first / last flags (the recording's own are those of its full acquisition order)."""
    acquisition = ismrmrd.Acquisition.from_array(np.ascontiguousarray(samples, dtype=np.complex64))
    head = ismrmrd.AcquisitionHeader.from_buffer_copy(head)
    head.scan_counter = counter
    head.acquisition_time_stamp = timestamp
    head.flags = (int(head.flags) & ~_SCAN_FLAGS) | flags
    acquisition.setHead(head)
    return acquisition


def read_config_xml(scfg: ScannerConfig) -> str:
    """The text of ``scfg.config_xml`` ("" when not set); ValueError naming a missing file."""
    if not scfg.config_xml:
        return ""
    path = Path(scfg.config_xml)
    if not path.is_file():
        raise ValueError(f"config_xml {scfg.config_xml} is not a file")
    return path.read_text()


def _prepare_subject(path: str | os.PathLike, subject_id: str, scfg: ScannerConfig, acq: AcquisitionConfig,
                     data: ScanInput) -> tuple[_Subject, str]:
    """The scan of one subject before its first line: where each slice stands, the open-loop
    order (``scanner.order``), the k-space as the receive array records it (the stream style)
    and the header sent with it."""
    n_total_slices, _, n_pe, _ = data.kspace.shape
    acq.check(n_pe)
    n_slices = min(n_total_slices, scfg.max_slices or n_total_slices)
    report = SubjectReport(str(subject_id), str(path), n_slices, int(n_pe), fov_mm=_fov_mm(data.header_xml),
                           reference="clean, every line" if data.templates is None else "fully sampled as recorded")
    run = _Subject(
        data, scfg, acq, report,
        EpisodeBatch(n_pe, acq.initial, acq.budget, n_slices, start=False, name="slice"),
        [_SliceState(SliceReport(s)) for s in range(n_slices)],
        DecisionBoard(), make_policy(scfg.fallback), np.zeros_like(data.kspace[:n_slices]),
    )
    if scfg.order:
        lines = [int(x) for x in run_episode(run.fallback, n_pe, acq.initial, acq.budget)]
        run.planned = line_order(n_pe, scfg.order, lines)
        run.initial_set = frozenset(lines[:acq.initial])
    run.style = scfg.stream_style(float(np.abs(data.kspace[:n_slices]).max(initial=0.0)))
    if run.style is not None and data.templates is not None:
        raise ValueError("a recorded scan is replayed as recorded: the scanner-style options (readout oversampling, "
                         "coils, noise, asymmetric echo) are for simulated subjects")
    header_xml = data.header_xml
    if run.style is not None:
        rng = np.random.default_rng(np.random.SeedSequence([scfg.noise_seed, zlib.crc32(str(subject_id).encode())]))
        run.sent = styled_kspace(data.kspace[:n_slices], run.style, rng, field_of_view_mm(data.header_xml))
        header_xml = styled_header(data.header_xml, run.style, run.sent.shape[1])
    return run, header_xml


def _play_subject(run: _Subject, header_xml: str, config_xml: str, require_gadget: bool,
                  on_slice_done: Callable[[int], None] | None) -> None:
    """Every line of the subject's schedule, each chosen by the gadget or the fallback and sent
    in its slot (``scanner.pace``), then the end of the stream; the link and the ZeroMQ pump are
    closed whatever happens."""
    scfg, acq, report, data = run.scfg, run.acq, run.report, run.data
    schedule = _schedule(report.n_slices, acq.initial, acq.budget, scfg.interleave, acq.lines_per_decision)
    period_ticks = (
        mrd.line_period_ms(data.seq, "interleaved" if scfg.interleave else "sequential")
        / mrd.TIMESTAMP_TICK_MS
    )
    pump: ZmqPump | None = None
    try:
        if scfg.feedback == "zmq":
            pump = ZmqPump(scfg.zmq_address, run.board, report.gadget_errors)
        run.link = _connect(scfg, run.board, report, require_gadget)
        if run.link is not None:
            run.link.handshake(scfg.config_name, header_xml, gadget_parameters(scfg, acq, pump),
                               config_xml=config_xml)
        run.start_ticks = _ticks_since_midnight()
        period_s = (scfg.line_period_ms or period_ticks * mrd.TIMESTAMP_TICK_MS) / 1e3
        first_line = time.perf_counter()
        for counter, (s, is_initial) in enumerate(schedule):
            line, source = run.choose(counter, s, is_initial)
            if scfg.pace:  # the line's slot in the sequence; a decision later than it delays it
                late = time.perf_counter() - (first_line + counter * period_s)
                if late < 0:
                    time.sleep(-late)
                elif late > PACE_JITTER_MS / 1e3:
                    report.paced_late_ms = max(report.paced_late_ms, 1e3 * late)
            run.acquire(counter, len(schedule), period_ticks, s, line, source)
            if run.episodes.is_done(s) and on_slice_done is not None:
                on_slice_done(s)
        if run.link is not None:
            _finish_link(run.link, report, scfg, len(schedule))
    finally:
        if run.link is not None:
            run.link.shutdown()
        if pump is not None:
            pump.close()


def scan_subject(
    path: str | os.PathLike,
    subject_id: str,
    scfg: ScannerConfig,
    acq: AcquisitionConfig,
    *,
    images_path: str | os.PathLike | None = None,
    require_gadget: bool = True,
    on_slice_done: Callable[[int], None] | None = None,
    figure: str | os.PathLike | None = None,
    data: ScanInput | None = None,
) -> SubjectReport:
    """Scan one subject file against the gadget of ``scfg`` (see the module docstring).

    images_path: ISMRMRD file to append this subject's images to (group ``subject_id``);
    require_gadget: raise ConnectionError when the gadget cannot be reached (else scan on the
    fallback order and record ``connection = "unreachable"``); on_slice_done(slice) is called
    when a slice has all its lines (progress bars); figure: where to draw the subject's lines
    and images (:func:`~sim_scanner.scanner.figure.plot_scan_subject`), or None. data: what to
    replay, when not the subject file at ``path`` (a recorded scan,
    :func:`~sim_scanner.dataset.streams.read_mrd_scan_input`).
    """
    started = time.perf_counter()
    config_xml = read_config_xml(scfg)
    data = read_scan_input(path) if data is None else data
    run, header_xml = _prepare_subject(path, subject_id, scfg, acq, data)
    report, n_slices = run.report, run.report.n_slices
    _play_subject(run, header_xml, config_xml, require_gadget, on_slice_done)

    images = run.link.images if run.link is not None else []
    arrived = run.link.image_times if run.link is not None else []
    by_slice = collect_images(report, images, run.board, n_slices, arrived, run.states)
    zero_filled_written, served = score_slices(
        report, run.states, by_slice, run.acquired, run.episodes.mask, data.clean[:n_slices]
    )
    report.duration_s = time.perf_counter() - started
    if images_path is not None:
        write_images(images_path, subject_id, data.header_xml, by_slice, zero_filled_written)
    if figure is not None:
        from sim_scanner.scanner.figure import plot_scan_subject

        log.info("figure of %s's slices: %s", subject_id, plot_scan_subject(report, served, data.clean[:n_slices],
                                                                             figure))
    log_subject(report, scfg)
    return report


def _next_line(
    st: _SliceState,
    episodes: EpisodeBatch,
    scfg: ScannerConfig,
    fallback: SamplingPolicy,
    board: DecisionBoard,
    connected: bool,
    deadline_s: float,
) -> tuple[int, str]:
    """The next chosen line of slice ``s``: the gadget's decision if valid and in time, else
    the fallback policy's; records the step in the slice report."""
    rep = st.report
    s = rep.slice
    step = int(episodes.step[s])
    latency = gadget_latency = None
    reason: str | None
    if scfg.feedback == "none":
        reason = REASON_OPEN_LOOP
    elif not connected:
        reason = REASON_DISCONNECTED
    else:
        got = board.wait((s, step), st.last_sent, st.last_sent + deadline_s)
        if got is None:
            reason = REASON_MISS
        else:
            decision, received = got
            latency = max(received - st.last_sent, 0.0) * 1e3  # 0: it came with an earlier line's train
            gadget_latency = float(decision.latency_us) / 1e3
            line = int(decision.line)
            if 0 <= line < episodes.n_pe and not episodes.masks[s, line]:
                reason = None
            else:
                reason = REASON_INVALID
                log.debug("slice %d step %d: invalid decision line %d", s, step, line)
    _record_step(rep, reason, latency, gadget_latency)
    if reason is None:
        return line, SOURCE_GADGET
    return int(select_next(fallback, episodes, rows=[s])[0]), SOURCE_FALLBACK


def _record_step(rep: SliceReport, reason: str | None, latency: float | None = None,
                 gadget_latency: float | None = None) -> None:
    """Count one chosen line of a slice: from the gadget (``reason`` None) or a fallback, why."""
    rep.latencies_ms.append(latency)
    rep.gadget_latencies_ms.append(gadget_latency)
    rep.fallback_reasons.append(reason)
    if reason is None:
        rep.from_gadget += 1
        return
    rep.fallbacks += 1
    if reason == REASON_MISS:
        rep.misses += 1
    elif reason == REASON_INVALID:
        rep.invalid += 1


def _connect(
    scfg: ScannerConfig, board: DecisionBoard, report: SubjectReport, require_gadget: bool
) -> GadgetLink | None:
    """The connection to the gadget; None (the subject recorded as unreachable) when it cannot
    be reached and ``require_gadget`` is false."""
    try:
        return GadgetLink.connect(scfg, board, report.gadget_errors, report.gadget_warnings)
    except ConnectionError as err:
        if require_gadget:
            raise
        log.warning("%s: %s; scanning on the fallback order", report.subject, err)
        report.connection = "unreachable"
        report.connection_error = str(err)
        board.close()
        return None


def _finish_link(link: GadgetLink, report: SubjectReport, scfg: ScannerConfig, n_lines: int) -> None:
    """Close the scan on the connection and record how the connection ended."""
    link.finish(scfg.close_timeout_s)
    report.server_closed = link.server_closed
    if link.lost_reason:
        report.connection = "lost"
        report.connection_error = link.lost_reason
        if report.connection_lost_at is None:
            report.connection_lost_at = n_lines


def _scan_inputs(data_dir: str | os.PathLike, split: str, scanner: ScannerConfig, mrd_group: str | None
                 ) -> tuple[list[str], list[Path], list[ScanInput | None], str, int]:
    """What :func:`run_scan` replays: the subjects, their files, the recorded scan when
    ``mrd_group`` names one (else None: each subject file is read), the split it reports and the
    slices in all (for the progress bar)."""
    if mrd_group is not None:
        from sim_scanner.dataset.streams import read_mrd_scan_input

        recorded = read_mrd_scan_input(data_dir, mrd_group)
        n_slices = min(len(recorded.kspace), scanner.max_slices or len(recorded.kspace))
        return [Path(data_dir).stem], [Path(data_dir)], [recorded], mrd_group, n_slices
    manifest = read_manifest(data_dir)
    subjects = split_subjects(data_dir, split, manifest)
    if scanner.max_subjects:
        subjects = subjects[: scanner.max_subjects]
    if not subjects:
        raise ValueError(f"split {split!r} of {data_dir} has no subjects")
    paths = [subject_path(data_dir, sid, manifest) for sid in subjects]
    n_slices = sum(min(n, scanner.max_slices or n) for n in (subject_slices(p) for p in paths))
    return subjects, paths, [None] * len(paths), split, n_slices


def run_scan(
    config: Config,
    data_dir: str | os.PathLike,
    split: str,
    out_dir: str | os.PathLike,
    *,
    scanner: ScannerConfig | None = None,
    progress: bool = True,
    mrd_group: str | None = None,
) -> ScanReport:
    """Scan every subject of ``split`` in dataset ``data_dir``; write ``out_dir/report.json``,
    ``out_dir/images.h5`` and the first subject's figure ``out_dir/scan.png``. With
    ``mrd_group``, ``data_dir`` is a recorded scan instead (an ISMRMRD file, that group), replayed
    as one subject and scored against its own fully sampled image
    (:func:`~sim_scanner.dataset.streams.read_mrd_scan_input`).

    config: sections ``scanner`` (or pass ``scanner``) and ``acquisition``. The first subject
    raises ConnectionError when the gadget cannot be reached; later subjects are scanned on the
    fallback order and recorded as unreachable.
    """
    from tqdm.auto import tqdm

    if scanner is None:
        scanner = config.sections["scanner"] if "scanner" in config.sections else ScannerConfig()
    acq: AcquisitionConfig = config["acquisition"]
    subjects, paths, inputs, split, n_slices = _scan_inputs(data_dir, split, scanner, mrd_group)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images_path = out / IMAGES_FILE
    if images_path.exists():
        log.info("replacing %s", images_path)
        images_path.unlink()
    report = ScanReport(
        data_dir=str(data_dir),
        split=split,
        scanner=to_dict(scanner),
        acquisition=to_dict(acq),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    log.info(
        "scanning %d subject(s) of %s/%s against %s (feedback %s, deadline %g ms, fallback %s%s)",
        len(subjects), data_dir, split, scanner.server, scanner.feedback, scanner.deadline_ms,
        scanner.fallback, ", interleaved" if scanner.interleave else "",
    )
    bar = tqdm(total=n_slices, unit="slice", desc="scan", disable=not progress)
    try:
        for i, (sid, p, given) in enumerate(zip(subjects, paths, inputs)):
            bar.set_postfix_str(sid)
            report.subjects.append(
                scan_subject(
                    p, sid, scanner, acq,
                    images_path=images_path,
                    require_gadget=i == 0,
                    on_slice_done=lambda _s: bar.update(),
                    figure=out / FIGURE_FILE if i == 0 else None,
                    data=given,
                )
            )
    finally:
        bar.close()
    report.totals = scan_totals(report.subjects)
    tmp = out / (REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    os.replace(tmp, out / REPORT_FILE)
    log.info("report written to %s", out / REPORT_FILE)
    return report
