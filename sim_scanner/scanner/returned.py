"""What came back from the gadget in a simulated scan: the returned images by slice, the image
scored for each slice (the gadget's when usable, else the scanner's own zero-filled one), their
scores against the reference, and the images written to the scan's MRD file."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import ismrmrd
import numpy as np
import torch

from masc_gadget.core.coils import coil_combine
from masc_gadget.core.metrics import slice_metrics
from masc_gadget.core.served import served_images
from sim_scanner.scanner.config import IMAGE_FROM_GADGET, IMAGE_ZERO_FILLED

if TYPE_CHECKING:
    from sim_scanner.scanner.link import DecisionBoard
    from sim_scanner.scanner.report import SubjectReport
    from sim_scanner.scanner.session import _SliceState

__all__ = ["collect_images", "image_array", "image_lines", "image_text", "images_by_slice", "pick_images",
           "score_images", "score_slices", "write_images"]

log = logging.getLogger("sim_scanner.scanner.session")


def image_array(image: ismrmrd.Image, shape: tuple[int, int]) -> np.ndarray:
    """A returned image as a (y, x) float32 magnitude matching ``shape``."""
    data = np.abs(np.asarray(image.data)).astype(np.float32)
    data = data.reshape([d for d in data.shape if d != 1] or [1])
    if data.shape == shape:
        return data
    if data.ndim == 2 and data.shape[::-1] == shape:
        return np.ascontiguousarray(data.T)
    raise ValueError(f"returned image of shape {data.shape} does not match the slice {shape}")


def image_text(image: ismrmrd.Image, key: str) -> str:
    """A text meta attribute of a returned image (``MASC.policy``, ``MASC.mar``), "" when absent."""
    try:
        value = image.meta.get(key)
    except (ValueError, SyntaxError, AttributeError):
        return ""
    if value is None:
        return ""
    return str(value if isinstance(value, str) else " ".join(str(v) for v in value))[:128]


def image_lines(image: ismrmrd.Image) -> list[int] | None:
    """The acquired lines a returned image lists in its meta attribute ``MASC.lines``."""
    try:
        value = image.meta.get("MASC.lines")
    except (ValueError, SyntaxError, AttributeError):  # unreadable attributes: not ours to judge
        return None
    if value is None:
        return None
    values = [value] if isinstance(value, str) else list(value)
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return None


def score_images(preds: np.ndarray, targets: np.ndarray) -> dict[str, list[float]]:
    """Per-slice metrics of (S, y, x) images against (S, y, x) clean targets."""
    values = slice_metrics(torch.from_numpy(preds), torch.from_numpy(targets))
    return {k: [float(x) for x in v] for k, v in values.items()}


def collect_images(
    report: SubjectReport, images: list[ismrmrd.Image], board: DecisionBoard, n_slices: int,
    arrived: list[float] | None = None, states: list[_SliceState] | None = None,
) -> dict[int, ismrmrd.Image]:
    """Record the returned images and late decisions; the first returned image of each slice.
    With ``arrived`` (each image's arrival time) and ``states`` (when each slice's last line
    went out), each slice's last-line-to-image latency goes into its ``image_latency_ms``."""
    report.images_returned = len(images)
    report.late_decisions = len(board.late_latencies_ms)
    report.late_latencies_ms = [float(v) for v in board.late_latencies_ms]
    by_slice = images_by_slice(images, n_slices, report.gadget_errors)
    if arrived is not None and states is not None:
        when = {id(image): t for image, t in zip(images, arrived)}
        for s, image in by_slice.items():
            if id(image) in when and s < len(states):
                states[s].report.image_latency_ms = max(when[id(image)] - states[s].last_sent, 0.0) * 1e3
    return by_slice


def score_slices(
    report: SubjectReport,
    states: list[_SliceState],
    by_slice: dict[int, ismrmrd.Image],
    acquired: np.ndarray,
    masks: torch.Tensor,
    targets: np.ndarray,
) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Score every slice (the gadget's image, else the scanner's zero-filled one) and its
    zero-filled reconstruction against ``targets``; fill the slice reports into ``report`` and
    sum them. Returns the zero-filled images that stand in for missing ones, by slice, and the
    (slice, H, W) images scored."""
    zf_images = served_images(coil_combine(torch.from_numpy(acquired), masks, "rss")).zero_filled.numpy()
    shape = tuple(targets.shape[1:])
    preds, zero_filled_written = pick_images(states, by_slice, zf_images, shape, report.gadget_errors)
    zf_scores = score_images(zf_images, targets)
    scores = score_images(preds, targets)
    for st in states:
        s = st.report.slice
        st.report.zero_filled_metrics = {k: v[s] for k, v in zf_scores.items()}
        st.report.metrics = {k: v[s] for k, v in scores.items()}
        report.slices.append(st.report)
    for rep in report.slices:
        report.lines += len(rep.lines)
        report.from_gadget += rep.from_gadget
        report.fallbacks += rep.fallbacks
        report.misses += rep.misses
        report.invalid += rep.invalid
    return zero_filled_written, preds


def pick_images(
    states: list[_SliceState],
    by_slice: dict[int, ismrmrd.Image],
    zf_images: np.ndarray,
    shape: tuple[int, ...],
    errors: list[str],
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """The image scored for each slice: the gadget's when it came back usable, else the
    scanner's zero-filled one (also returned by slice, to be written)."""
    preds = zf_images.copy()
    zero_filled_written: dict[int, np.ndarray] = {}
    for st in states:
        s = st.report.slice
        image = by_slice.get(s)
        if image is not None:
            st.report.image_lines = image_lines(image)
            st.report.policy, st.report.served = image_text(image, "MASC.policy"), image_text(image, "MASC.mar")
            if st.report.image_lines is not None and sorted(st.report.image_lines) != sorted(
                st.report.lines
            ):
                errors.append(
                    f"slice {s}: the gadget's image lists lines {st.report.image_lines}, the "
                    f"scanner acquired {st.report.lines}"
                )
            try:
                preds[s] = image_array(image, shape)
                st.report.image_source = IMAGE_FROM_GADGET
                continue
            except ValueError as err:
                errors.append(f"slice {s}: {err}")
        st.report.image_source = IMAGE_ZERO_FILLED
        zero_filled_written[s] = zf_images[s]
    return preds, zero_filled_written


def images_by_slice(
    images: list[ismrmrd.Image], n_slices: int, errors: list[str]
) -> dict[int, ismrmrd.Image]:
    """The first returned image of each scanned slice."""
    out: dict[int, ismrmrd.Image] = {}
    for image in images:
        s = int(image.slice)
        if not 0 <= s < n_slices:
            errors.append(f"the gadget returned an image for slice {s}, outside 0..{n_slices - 1}")
        elif s in out:
            log.debug("ignoring a further image of slice %d", s)
        else:
            out[s] = image
    return out


def write_images(
    path: str | os.PathLike,
    subject_id: str,
    header_xml: str,
    returned: dict[int, ismrmrd.Image],
    zero_filled_images: dict[int, np.ndarray],
) -> None:
    dset = ismrmrd.Dataset(str(path), subject_id, create_if_needed=True)
    try:
        dset.write_xml_header(header_xml)
        for s in sorted(returned):
            dset.append_image("images", returned[s])
        for s in sorted(zero_filled_images):
            image = ismrmrd.Image.from_array(zero_filled_images[s])
            image.slice = s
            image.image_index = s
            dset.append_image("scanner_zero_filled", image)
    finally:
        dset.close()
