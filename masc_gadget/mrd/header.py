"""ISMRMRD (MRD v1) headers and acquisition fields, as the gadget and the scanner read them.

Protocol-side helpers only: numpy and ismrmrd (plus ``xsdata``, the XML binding that ismrmrd >= 1.14
is built on); never torch.

Header parsing is lenient where real peers differ and strict where it matters:

* strings may end in NULs and whitespace (clients NUL-terminate them): stripped;
* ``<version>`` is dropped when the library cannot take it (older / newer ISMRMRD tools write
  values such as ``2.0`` that do not convert), and :func:`serialize_header` never writes it,
  because newer ISMRMRD libraries reject a version they do not know on re-serialisation;
* a header without the ISMRMRD namespace is read as if it had it;
* elements from a newer schema that this library does not know are ignored, with a warning;
* values that do not convert (``<x>abc</x>`` for an integer) and anything that is not an
  ``ismrmrdHeader`` raise ``ValueError("ISMRMRD header does not parse: ...")``. (An *empty*
  element with a schema default, ``<x></x>``, takes that default: xsdata's behaviour.)

Headers come from peers, so :func:`parse_xml` (used for the header and for stream
configurations) refuses document type declarations (and with them entities) and nesting
deeper than :data:`MAX_XML_DEPTH` before anything else reads the text, and error messages quote
at most :data:`QUOTE_CHARS` characters of any value (:func:`quote`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import types
import typing
import xml.etree.ElementTree as ET
from typing import NamedTuple

import ismrmrd
import ismrmrd.xsd

from masc_gadget.config import QUOTE_CHARS, quote

log = logging.getLogger(__name__)

ISMRMRD_NAMESPACE = "http://www.ismrm.org/ISMRMRD"
"""XML namespace of the ISMRMRD v1 header."""

_context = (
    None  # xsdata XmlContext, built on first use and shared (it is a cache of class metadata)
)

MAX_XML_DEPTH = 32
"""Deepest element nesting accepted in XML from a peer (an ISMRMRD header nests 5 levels)."""

def clip(text: str, limit: int = 4 * QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters (for messages that may carry a peer's data)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _LimitedTreeBuilder(ET.TreeBuilder):
    """An ElementTree builder that stops at a document type declaration or too deep nesting."""

    def __init__(self, what: str, max_depth: int) -> None:
        super().__init__()
        self._what, self._max_depth, self._depth = what, max_depth, 0

    def start(self, tag, attrs):  # noqa: D102 - ElementTree's target interface
        self._depth += 1
        if self._depth > self._max_depth:
            raise ValueError(f"{self._what}: XML nested deeper than {self._max_depth} elements")
        return super().start(tag, attrs)

    def end(self, tag):  # noqa: D102
        self._depth -= 1
        return super().end(tag)

    def doctype(self, name, pubid, system):  # noqa: D102
        raise ValueError(f"{self._what}: XML document type declarations (<!DOCTYPE>) are not allowed")


def parse_xml(text: str | bytes, what: str, max_depth: int = MAX_XML_DEPTH) -> ET.Element:
    """Parse XML from a peer: no ``<!DOCTYPE>`` (so no entities), at most ``max_depth`` nested
    elements. Raises ``ValueError("{what}: ...")``; ``ET.ParseError`` for malformed XML."""
    parser = ET.XMLParser(target=_LimitedTreeBuilder(what, max_depth))
    parser.feed(text)
    return parser.close()


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _clean_text(xml: str | bytes | bytearray | memoryview) -> str | bytes:
    """Strip NULs and whitespace from both ends; reject empty or non-text input."""
    if isinstance(xml, (bytearray, memoryview)):
        xml = bytes(xml)
    if isinstance(xml, bytes):
        text: str | bytes = xml.strip(b"\x00 \t\r\n")
    elif isinstance(xml, str):
        text = xml.strip("\x00 \t\r\n\ufeff")
    else:
        raise ValueError(
            f"ISMRMRD header does not parse: expected str or bytes, got {type(xml).__name__}"
        )
    if not text:
        raise ValueError("ISMRMRD header does not parse: the header is empty")
    return text


def _xsdata_parse(text: str | bytes, *, fail_on_unknown: bool) -> ismrmrd.xsd.ismrmrdHeader:
    """Parse with ismrmrd's own binding; unconvertible values are errors, not silent strings."""
    global _context
    from xsdata.formats.dataclass.context import XmlContext
    from xsdata.formats.dataclass.parsers import XmlParser
    from xsdata.formats.dataclass.parsers.config import ParserConfig

    if _context is None:
        _context = XmlContext()
    parser = XmlParser(
        config=ParserConfig(
            fail_on_unknown_properties=fail_on_unknown, fail_on_converter_warnings=True
        ),
        context=_context,
    )
    if isinstance(text, bytes):
        header = parser.from_bytes(text, ismrmrd.xsd.ismrmrdHeader)
    else:
        header = parser.from_string(text, ismrmrd.xsd.ismrmrdHeader)
    errors: list[str] = []
    _check_types(header, ismrmrd.xsd.ismrmrdHeader, "ismrmrdHeader", errors)
    if errors:
        raise ValueError("; ".join(errors[:5]))
    return header


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _check_types(value: object, hint: object, path: str, errors: list[str]) -> None:
    """Collect values that do not have their schema type (xsdata can leave '' or a wrong type)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            _check_types(value, options[0], path, errors)
        elif not any(isinstance(value, typing.get_origin(a) or a) for a in options):
            errors.append(f"{path} has an unexpected value {quote(value)}")
        return
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path} must be a list, got {quote(value)}")
            return
        for i, item in enumerate(value):
            _check_types(item, args[0], f"{path}[{i}]", errors)
        return
    if not isinstance(hint, type):
        return
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            errors.append(f"{path} must be a <{hint.__name__}> element, got {quote(value)}")
            return
        hints = _hints(hint)
        for f in dataclasses.fields(hint):
            _check_types(getattr(value, f.name), hints[f.name], f"{path}.{f.name}", errors)
        return
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        errors.append(f"{path} must be {hint.__name__}, got {quote(value)}")


def _repair(root: ET.Element) -> list[str]:
    """Drop a non-integer ``<version>``; put unqualified elements in the ISMRMRD namespace."""
    repairs = []
    for child in list(root):
        text = child.text or ""
        plain_integer = len(child) == 0 and text.strip().lstrip("+-").isdigit()
        if _local(child.tag) == "version" and not plain_integer:
            root.remove(child)
            repairs.append(f"dropped <version>{quote((child.text or '').strip())}</version>")
    if not root.tag.startswith("{"):
        for element in root.iter():
            if isinstance(element.tag, str) and not element.tag.startswith("{"):
                element.tag = f"{{{ISMRMRD_NAMESPACE}}}{element.tag}"
        repairs.append("added the ISMRMRD namespace")
    return repairs


def parse_header(xml: str | bytes) -> ismrmrd.xsd.ismrmrdHeader:
    """Parse an ISMRMRD XML header leniently (see the module docstring).

    Raises ``ValueError("ISMRMRD header does not parse: ...")`` for anything that is not a
    usable ``ismrmrdHeader``.
    """
    text = _clean_text(xml)
    try:
        root = parse_xml(text, "ISMRMRD header does not parse")
    except ET.ParseError as error:
        raise ValueError(f"ISMRMRD header does not parse: not well-formed XML ({error})") from None
    if _local(root.tag) != "ismrmrdHeader":
        raise ValueError(
            "ISMRMRD header does not parse: root element must be <ismrmrdHeader>, "
            f"got <{_local(root.tag)[:QUOTE_CHARS]}>"
        )
    try:
        return _xsdata_parse(text, fail_on_unknown=True)
    except (ValueError, TypeError) as error:  # xsdata's errors are ValueErrors
        first_error = error
    repairs = _repair(root)
    repaired = ET.tostring(root, encoding="unicode")
    unknown_error = first_error
    if repairs:
        try:
            header = _xsdata_parse(repaired, fail_on_unknown=True)
        except (ValueError, TypeError) as error:
            unknown_error = error
        else:
            log.debug("ISMRMRD header parsed after repairs: %s", "; ".join(repairs))
            return header
    try:
        header = _xsdata_parse(repaired, fail_on_unknown=False)
    except (ValueError, TypeError):
        raise ValueError(f"ISMRMRD header does not parse: {clip(str(first_error))}") from None
    log.warning(
        "ISMRMRD header has elements this library does not know, ignored: %s",
        clip(str(unknown_error)),
    )
    return header


def serialize_header(header: ismrmrd.xsd.ismrmrdHeader) -> str:
    """The header as ISMRMRD XML text (UTF-8 declaration, no ``<version>``).

    Round-trips through :func:`parse_header` and ``ismrmrd.xsd.CreateFromDocument``.
    ``<version>`` is left out because ISMRMRD libraries reject versions they do not know.
    """
    if not isinstance(header, ismrmrd.xsd.ismrmrdHeader):
        raise ValueError(f"expected an ismrmrd.xsd.ismrmrdHeader, got {type(header).__name__}")
    return ismrmrd.xsd.ToXML(dataclasses.replace(header, version=None), encoding="UTF-8")


class EncodingGeometry(NamedTuple):
    """What the gadget needs from a header's first encoding (2D Cartesian, one line per PE step)."""

    n_readout: int
    """Samples per readout (encoded matrix x)."""
    n_pe: int
    """Phase-encoding lines (encoded matrix y)."""
    n_slices: int
    """Slices (encoding limit ``slice`` maximum + 1; 1 without a limit)."""
    fov_mm: tuple[float, float, float]
    """Encoded field of view (readout, PE, slice thickness), mm."""
    pe_centre: int
    """The k-space centre line (``kspace_encoding_step_1`` centre; n_pe // 2 without a limit)."""
    recon_readout: int = 0
    """Readout samples of the reconstruction grid: the recon space's matrix x (the encoded one
    without a recon space); 0: ``n_readout``."""
    recon_pe: int = 0
    """Recon space matrix y; 0: ``n_pe``."""
    recon_fov_mm: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Recon field of view (x, y, z), mm; zeros: ``fov_mm``."""
    pe_min: int = 0
    """The first line the scanner acquires (``kspace_encoding_step_1`` minimum; 0 without a limit)."""
    pe_max: int = -1
    """The last one (its maximum); -1: ``n_pe - 1``."""

    @property
    def acquirable_rows(self) -> tuple[int, int]:
        """(first, last) grid rows of the lines the scanner can acquire (its encoding limits, moved
        by :attr:`pe_offset`, within the grid): a decision outside them names a line the scanner
        does not have (partial Fourier, an off-centre centre line)."""
        last = self.n_pe - 1 if self.pe_max < 0 else self.pe_max
        return max(0, self.pe_min + self.pe_offset), min(self.n_pe - 1, last + self.pe_offset)

    @property
    def grid_readout(self) -> int:
        """Readout samples of the grid the lines are reconstructed on (recon space x)."""
        return self.recon_readout or self.n_readout

    @property
    def image_fov_mm(self) -> tuple[float, float, float]:
        """The recon field of view (the encoded one without a recon space)."""
        return self.recon_fov_mm if min(self.recon_fov_mm) > 0 else self.fov_mm

    @property
    def removes_oversampling(self) -> bool:
        """Whether lines are oversampled along the readout: the encoded and recon matrix x or
        field of view x differ (Gadgetron's ``RemoveROOversamplingGadget`` rule)."""
        return self.grid_readout != self.n_readout or self.image_fov_mm[0] != self.fov_mm[0]

    @property
    def readout_ratio(self) -> float:
        """Encoded / recon field of view along the readout (2 for the usual oversampling)."""
        return self.fov_mm[0] / self.image_fov_mm[0]

    @property
    def pe_offset(self) -> int:
        """Grid row of line ``kspace_encode_step_1`` = that line + ``pe_offset``: the header's centre
        line lands on the grid's centre row ``n_pe // 2`` (asymmetric / partial Fourier phase
        encoding: the lines never acquired stay zero)."""
        return self.n_pe // 2 - self.pe_centre


def receiver_channels(header: ismrmrd.xsd.ismrmrdHeader) -> int | None:
    """The header's coil count (``acquisitionSystemInformation.receiverChannels``); None when it
    does not say."""
    system = getattr(header, "acquisitionSystemInformation", None)
    count = None if system is None else system.receiverChannels
    if count is None:
        return None
    if int(count) < 1:
        raise ValueError(f"ISMRMRD header receiverChannels must be >= 1, got {count}")
    return int(count)


def encoding_geometry(header: ismrmrd.xsd.ismrmrdHeader | str | bytes) -> EncodingGeometry:
    """Matrix, slices, FOV and centre line of ``header`` (a parsed header or its XML)."""
    if not isinstance(header, ismrmrd.xsd.ismrmrdHeader):
        header = parse_header(header)
    if not header.encoding:
        raise ValueError("ISMRMRD header has no <encoding>")
    encoding = header.encoding[0]
    space = encoding.encodedSpace
    if space is None or space.matrixSize is None:
        raise ValueError("ISMRMRD header has no <encoding><encodedSpace><matrixSize>")
    if space.fieldOfView_mm is None:
        raise ValueError("ISMRMRD header has no <encoding><encodedSpace><fieldOfView_mm>")
    n_readout, n_pe = int(space.matrixSize.x), int(space.matrixSize.y)
    if n_readout < 1 or n_pe < 1:
        raise ValueError(
            f"ISMRMRD header encodedSpace matrixSize must be >= 1, got x={n_readout}, y={n_pe}"
        )
    fov = space.fieldOfView_mm
    fov_mm = (float(fov.x), float(fov.y), float(fov.z))
    if not all(math.isfinite(v) and v > 0 for v in fov_mm):
        raise ValueError(
            f"ISMRMRD header encodedSpace fieldOfView_mm must be finite and > 0, got {list(fov_mm)}"
        )
    limits = encoding.encodingLimits
    n_slices = 1
    pe_centre, pe_min, pe_max = n_pe // 2, 0, -1
    if limits is not None:
        if limits.slice is not None:
            n_slices = int(limits.slice.maximum) + 1
        if limits.kspace_encoding_step_1 is not None:
            step = limits.kspace_encoding_step_1
            pe_centre = int(step.center)
            pe_min = int(step.minimum) if step.minimum is not None else 0
            pe_max = int(step.maximum) if step.maximum is not None else -1
    if n_slices < 1:
        raise ValueError(f"ISMRMRD header slice limit must give >= 1 slice, got {n_slices}")
    if not 0 <= pe_centre < n_pe:
        raise ValueError(
            f"ISMRMRD header kspace_encoding_step_1 center must be in [0, {n_pe}), got {pe_centre}"
        )
    recon = encoding.reconSpace
    recon_readout = recon_pe = 0
    recon_fov = (0.0, 0.0, 0.0)
    if recon is not None and recon.matrixSize is not None:
        recon_readout, recon_pe = int(recon.matrixSize.x), int(recon.matrixSize.y)
        if recon_readout < 1 or recon_pe < 1:
            raise ValueError(f"ISMRMRD header reconSpace matrixSize must be >= 1, got x={recon_readout}, "
                             f"y={recon_pe}")
        if recon.fieldOfView_mm is not None:
            rf = recon.fieldOfView_mm
            recon_fov = (float(rf.x), float(rf.y), float(rf.z))
            if not all(math.isfinite(v) and v > 0 for v in recon_fov):
                raise ValueError(f"ISMRMRD header reconSpace fieldOfView_mm must be finite and > 0, got "
                                 f"{list(recon_fov)}")
    geometry = EncodingGeometry(n_readout, n_pe, n_slices, fov_mm, pe_centre, recon_readout, recon_pe, recon_fov,
                                pe_min, pe_max)
    if geometry.removes_oversampling:
        kept = int(n_readout / geometry.readout_ratio)
        if not 1 <= kept <= n_readout:
            raise ValueError(f"ISMRMRD header: encoded field of view x {fov_mm[0]} mm over recon "
                             f"{geometry.image_fov_mm[0]} mm keeps {kept} of {n_readout} readout samples; the recon "
                             f"field of view must be within the encoded one")
        if kept > geometry.grid_readout:
            raise ValueError(f"ISMRMRD header: {n_readout} readout samples over {fov_mm[0]} mm keep {kept} over the "
                             f"recon field of view {geometry.image_fov_mm[0]} mm, more than the recon matrix x "
                             f"({geometry.grid_readout}); such a readout is not reconstructed here")
    return geometry


def slice_limit(header: ismrmrd.xsd.ismrmrdHeader) -> int | None:
    """Slices the first encoding's limits allow (``slice.maximum + 1``); None without a slice
    limit (:func:`encoding_geometry` then counts one slice)."""
    limits = header.encoding[0].encodingLimits if header.encoding else None
    if limits is None or limits.slice is None or limits.slice.maximum is None:
        return None
    return int(limits.slice.maximum) + 1


def flag_mask(*flags: int) -> int:
    """The ``flags`` bit mask of ISMRMRD flag numbers (``ismrmrd.ACQ_*``, 1-based)."""
    mask = 0
    for flag in flags:
        if not 1 <= int(flag) <= 64:
            raise ValueError(f"ISMRMRD flags are numbered 1..64, got {flag}")
        mask |= 1 << (int(flag) - 1)
    return mask


NOT_IMAGING = flag_mask(
    ismrmrd.ACQ_IS_NOISE_MEASUREMENT,
    ismrmrd.ACQ_IS_NAVIGATION_DATA,
    ismrmrd.ACQ_IS_PHASECORR_DATA,
    ismrmrd.ACQ_IS_HPFEEDBACK_DATA,
    ismrmrd.ACQ_IS_DUMMYSCAN_DATA,
    ismrmrd.ACQ_IS_RTFEEDBACK_DATA,
    ismrmrd.ACQ_IS_SURFACECOILCORRECTIONSCAN_DATA,
    ismrmrd.ACQ_IS_PHASE_STABILIZATION_REFERENCE,
    ismrmrd.ACQ_IS_PHASE_STABILIZATION,
    ismrmrd.ACQ_IS_PARALLEL_CALIBRATION,  # reference lines only (not ..._AND_IMAGING)
)
"""The flags of acquisitions that carry no line of the image: noise, navigators, phase
correction, feedback, dummy scans, coil-correction and phase-stabilisation scans, and
parallel-imaging reference lines sent apart from the image's. The one list every reader of
lines uses (:func:`is_imaging_line`)."""


def is_imaging_line(flags: int) -> bool:
    """Whether an acquisition with header ``flags`` carries a line of the image (none of
    :data:`NOT_IMAGING`; MASC's in-band feedback is told apart by
    :func:`masc_gadget.mrd.feedback.is_feedback`)."""
    return not int(flags) & NOT_IMAGING
