"""Per-subject scanner and positioning variation (config section ``variation``).

The anatomy and implant vary per subject (:mod:`sim_scanner.physics.phantom`,
:mod:`sim_scanner.physics.implant`); this module varies how each subject is *scanned*: where
the patient lies in the FOV and how far it is turned, where the slab sits along the implant,
the field strength, bandwidth and noise level, the coil's receive shading, and the implant's
materials. :func:`draw_variation` draws one subject's :class:`SubjectVariation` from a
generator of its own, so the anatomy and implant drawn from the subject's main stream do not
change, and with every field of :class:`VariationConfig` at its default it changes nothing.

Every quantity has a fixed slot of the generator's first :data:`N_DRAWS` uniforms, drawn whether
or not it varies, so switching one variation on does not change the values of the others.

Geometry (coordinates of :mod:`sim_scanner.physics.grid`): the patient is turned by
``rotation_deg`` about the z axis through the origin (the body's long axis at the hip level:
B0, the slice normal and the body axis are all z, so the Fourier dipole kernel
``1/3 - kz^2/|k|^2`` is unchanged by the turn and the field of the turned patient is the turned
field), then the FOV is centred on the turned centring point and moved by ``fov_shift_mm``.
Readout (x) and phase encoding (y) stay the scanner's axes, so the artifacts turn relative to
the anatomy as on a real scanner.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from sim_scanner.physics.grid import Grid, rotate_zyx
from sim_scanner.physics.implant import MATERIAL_CHI_PPM, ImplantConfig
from sim_scanner.physics.sequence import SequenceConfig

if TYPE_CHECKING:
    from sim_scanner.physics.forward import PhysicsConfig

N_DRAWS = 20
"""Uniforms drawn per subject; slot of each quantity: see :func:`draw_variation`."""

_N_COIL_ELEMENTS = 4
"""Receive elements: two in an anterior array on the body, two in a posterior one in the table."""


def _check_range(name: str, value: tuple[float, ...]) -> None:
    """ValueError unless ``value`` is a finite (low, high) pair with 0 < low <= high."""
    if len(value) != 2 or not all(math.isfinite(float(v)) for v in value):
        raise ValueError(f"{name} must be two finite numbers (low, high), got {list(value)}")
    if not 0 < float(value[0]) <= float(value[1]):
        raise ValueError(f"{name} must be (low, high) with 0 < low <= high, got {list(value)}")


@dataclass(frozen=True)
class VariationConfig:
    """Per-subject scanner and positioning variation (config section ``variation``).

    Every default means "no variation": the dataset is then simulated exactly as without this
    section. Ranges are drawn uniformly per subject; ``+-`` maxima uniformly in [-max, max].
    """

    fov_shift_mm: tuple[float, float] = (0.0, 0.0)
    """Largest shift (+-) of the FOV centre relative to the anatomy along x (left-right) and y
    (antero-posterior), mm: where the radiographer centred the scan."""
    rotation_deg: float = 0.0
    """Largest in-plane turn (+-) of the whole patient (anatomy and implant) about the body's
    long axis, degrees; positive from +x (left) towards +y (posterior)."""
    slab_offset_jitter_mm: float = 0.0
    """Largest shift (+-) of the slice stack along z, added to ``sequence.slab_offset_mm``, mm."""
    b0_t: tuple[float, ...] = ()
    """Field strengths (tesla) to choose from uniformly; empty: ``sequence.b0_t``."""
    bandwidth_scale: tuple[float, float] = (1.0, 1.0)
    """Range of a factor on the readout bandwidth per pixel and, with it, on the RF (slice
    selection) bandwidth, as high-bandwidth metal protocols raise both. The slice profile's
    shape is independent of the RF bandwidth in the forward model, which sets only how far
    off-resonance moves the slice."""
    snr: tuple[float, float] = (0.0, 0.0)
    """Range of the image SNR of the metal partner (mean tissue signal / noise std);
    (0, 0): ``physics.snr``. The clean partner stays noiseless unless ``physics.noise_in_clean``."""
    coil_shading: float = 0.0
    """Strength of the receive-coil shading of both partners: the map is the combined
    sensitivity of anterior and posterior surface arrays (random per-subject gains, positions
    and falloff) to the power ``coil_shading``, normalised to mean 1 over the body; 0: flat,
    1: the arrays' full profile (the body centre typically 1.5 to 3 times darker than the skin
    nearest an element)."""
    stem_materials: tuple[str, ...] = ()
    """Stem materials to choose from uniformly (keys of MATERIAL_CHI_PPM); empty:
    ``implant.stem_material``."""
    head_materials: tuple[str, ...] = ()
    """Head materials to choose from uniformly; empty: ``implant.head_material``."""

    def __post_init__(self) -> None:
        if len(self.fov_shift_mm) != 2 or not all(
            math.isfinite(float(v)) and float(v) >= 0 for v in self.fov_shift_mm
        ):
            raise ValueError(
                "fov_shift_mm must be two finite maxima >= 0 (x, y) in mm, "
                f"got {list(self.fov_shift_mm)}"
            )
        if not 0.0 <= self.rotation_deg <= 180.0:
            raise ValueError(f"rotation_deg must lie within [0, 180], got {self.rotation_deg}")
        if not (math.isfinite(self.slab_offset_jitter_mm) and self.slab_offset_jitter_mm >= 0):
            raise ValueError(
                f"slab_offset_jitter_mm must be finite and >= 0, got {self.slab_offset_jitter_mm}"
            )
        if not all(math.isfinite(float(b)) and 0 < float(b) <= 20.0 for b in self.b0_t):
            raise ValueError(f"b0_t must list field strengths in (0, 20] tesla, got {list(self.b0_t)}")
        _check_range("bandwidth_scale", self.bandwidth_scale)
        if tuple(self.snr) != (0.0, 0.0):
            _check_range("snr", self.snr)
        if not 0.0 <= self.coil_shading <= 3.0:
            raise ValueError(f"coil_shading must lie within [0, 3], got {self.coil_shading}")
        for name in ("stem_materials", "head_materials"):
            unknown = [m for m in getattr(self, name) if m not in MATERIAL_CHI_PPM]
            if unknown:
                raise ValueError(
                    f"{name}: unknown material {unknown[0]!r}; known materials: "
                    + ", ".join(sorted(MATERIAL_CHI_PPM))
                )


@dataclass(frozen=True)
class CoilShading:
    """One subject's receive arrays, relative to its body's in-plane extent."""

    strength: float
    """Exponent of the combined sensitivity (:attr:`VariationConfig.coil_shading`); 0: flat."""
    gains: tuple[float, ...]
    """Gain of each element: anterior array, then posterior; in each, right (-x) then left."""
    array_offsets: tuple[float, float]
    """Lateral offset of the anterior and posterior array centres from the body centre, as a
    fraction of the body width."""
    separation: float
    """Distance between the two elements of an array, as a fraction of the body width."""
    falloff: float
    """Distance at which an element's sensitivity halves, as a fraction of the body depth."""


@dataclass(frozen=True)
class SubjectVariation:
    """What :func:`draw_variation` drew for one subject (effective values, not ranges)."""

    fov_shift_mm: tuple[float, float]
    """Shift of the FOV centre relative to the anatomy along x and y, mm."""
    rotation_deg: float
    """Turn of the patient about z (:func:`~sim_scanner.physics.grid.rotate_zyx`), degrees."""
    slab_offset_jitter_mm: float
    b0_t: float
    bandwidth_scale: float
    readout_bw_hz_per_px: float
    rf_bw_hz: float
    slab_offset_mm: float
    """The subject's ``sequence.slab_offset_mm`` (config value + jitter)."""
    snr: float
    stem_material: str
    head_material: str
    coil: CoilShading

    def sequence(self, seq: SequenceConfig) -> SequenceConfig:
        """The subject's sequence: ``seq`` with this field strength, bandwidths and slab offset."""
        return replace(seq, **self.sequence_overrides())

    def sequence_overrides(self) -> dict[str, float]:
        return {"b0_t": self.b0_t, "readout_bw_hz_per_px": self.readout_bw_hz_per_px,
                "rf_bw_hz": self.rf_bw_hz, "slab_offset_mm": self.slab_offset_mm}

    def physics(self, phys: PhysicsConfig) -> PhysicsConfig:
        """The subject's physics settings: ``phys`` with this SNR."""
        return replace(phys, snr=self.snr)

    def implant(self, icfg: ImplantConfig) -> ImplantConfig:
        """The subject's implant config: ``icfg`` with these stem and head materials."""
        return replace(icfg, stem_material=self.stem_material, head_material=self.head_material)

    def fov_centre(self, centre_mm: tuple[float, float]) -> tuple[float, float]:
        """(y, x) FOV centre of a scan centred on anatomical point ``centre_mm`` (y, x): the
        point turned with the patient, plus the FOV shift."""
        y, x = float(centre_mm[0]), float(centre_mm[1])
        if self.rotation_deg != 0.0:
            _, y, x = rotate_zyx((0.0, y, x), self.rotation_deg)
        return (y + self.fov_shift_mm[1], x + self.fov_shift_mm[0])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record (the subject file's ``scanner`` metadata): the drawn values, and
        under ``sequence`` / ``physics`` the config fields they override for this subject."""
        out = asdict(self)
        out["fov_shift_mm"] = [float(v) for v in self.fov_shift_mm]
        out["coil"] = {k: list(v) if isinstance(v, tuple) else v for k, v in out["coil"].items()}
        out["sequence"] = self.sequence_overrides()
        out["physics"] = {"snr": self.snr}
        return out


def _pick(u: float, options: tuple, default: Any) -> Any:
    """Option ``floor(u * n)`` of ``options`` (``default`` when empty)."""
    return options[min(int(u * len(options)), len(options) - 1)] if options else default


def _symmetric(u: float, largest: float) -> float:
    """Uniform in [-largest, largest] from u in [0, 1); exactly 0.0 (never -0.0) for largest 0."""
    return float((2.0 * u - 1.0) * largest) + 0.0


def _in_range(u: float, bounds: tuple[float, float]) -> float:
    """Uniform in [low, high] from u in [0, 1); exactly low when low == high."""
    low, high = float(bounds[0]), float(bounds[1])
    return low + (high - low) * float(u) if high != low else low


def draw_variation(cfg: VariationConfig, seq: SequenceConfig, phys: PhysicsConfig,
                   icfg: ImplantConfig, rng: np.random.Generator) -> SubjectVariation:
    """Draw one subject's variation from ``rng`` (use a generator of its own, e.g.
    ``default_rng(SeedSequence([seed, index, 1]))``): :data:`N_DRAWS` uniforms, whose slots are
    0-1 FOV shift x, y; 2 rotation; 3 slab jitter; 4 field strength; 5 bandwidth; 6 SNR;
    7 stem and 8 head material; 9-16 coil shading; 17-19 spare. A quantity that does not vary
    takes the value of ``seq`` / ``phys`` / ``icfg`` exactly.
    """
    u = rng.random(N_DRAWS)
    jitter = _symmetric(u[3], cfg.slab_offset_jitter_mm)
    scale = _in_range(u[5], cfg.bandwidth_scale)
    coil = CoilShading(
        strength=float(cfg.coil_shading),
        gains=tuple(float(0.6 + 0.8 * u[9 + i]) for i in range(_N_COIL_ELEMENTS)),
        array_offsets=(_symmetric(u[13], 0.25), _symmetric(u[14], 0.25)),
        separation=_in_range(u[15], (0.3, 0.6)),
        falloff=_in_range(u[16], (0.2, 0.4)),
    )
    return SubjectVariation(
        fov_shift_mm=(_symmetric(u[0], cfg.fov_shift_mm[0]), _symmetric(u[1], cfg.fov_shift_mm[1])),
        rotation_deg=_symmetric(u[2], cfg.rotation_deg),
        slab_offset_jitter_mm=jitter,
        b0_t=float(_pick(u[4], tuple(cfg.b0_t), seq.b0_t)),
        bandwidth_scale=scale,
        readout_bw_hz_per_px=float(seq.readout_bw_hz_per_px) * scale,
        rf_bw_hz=float(seq.rf_bw_hz) * scale,
        slab_offset_mm=float(seq.slab_offset_mm) + jitter,
        snr=_in_range(u[6], cfg.snr) if tuple(cfg.snr) != (0.0, 0.0) else float(phys.snr),
        stem_material=str(_pick(u[7], tuple(cfg.stem_materials), icfg.stem_material)),
        head_material=str(_pick(u[8], tuple(cfg.head_materials), icfg.head_material)),
        coil=coil,
    )


def coil_sensitivity(coil: CoilShading, body: np.ndarray, grid: Grid) -> np.ndarray:
    """Receive shading (float32 (1, ny, nx), > 0, mean 1 over the body) of ``grid``'s planes.

    body: bool [z, y, x] on ``grid``, where there is signal. Two arrays of two elements sit
    30 % of the falloff distance outside the body's anterior (-y) and posterior (+y) extremes,
    each centred on the body's left-right middle plus its offset; an element at distance r has
    sensitivity ``gain / (1 + (r / falloff)^2)``, the elements combine as root sum of squares,
    and the result is raised to ``coil.strength``. Constant along z (elements longer than the
    slab). All ones when the strength is 0 or there is no body.
    """
    _, ny, nx = grid.shape
    inplane = body.any(axis=0)
    if coil.strength == 0.0 or not inplane.any():
        return np.ones((1, ny, nx), np.float32)
    y, x = grid.axis_mm(1).astype(np.float64), grid.axis_mm(2).astype(np.float64)
    rows, cols = np.nonzero(inplane.any(axis=1))[0], np.nonzero(inplane.any(axis=0))[0]
    y0, y1, x0, x1 = y[rows[0]], y[rows[-1]], x[cols[0]], x[cols[-1]]
    width, depth = max(x1 - x0, 1.0), max(y1 - y0, 1.0)
    falloff = coil.falloff * depth
    standoff = 0.3 * falloff
    elements = []
    for k, y_array in enumerate((y0 - standoff, y1 + standoff)):
        centre = 0.5 * (x0 + x1) + coil.array_offsets[k] * width
        for side in (-1.0, 1.0):
            elements.append((y_array, centre + side * 0.5 * coil.separation * width))
    power = np.zeros((ny, nx))
    for gain, (ey, ex) in zip(coil.gains, elements):
        r2 = (y[:, None] - ey) ** 2 + (x[None, :] - ex) ** 2
        power += (gain / (1.0 + r2 / falloff**2)) ** 2
    shading = power ** (0.5 * coil.strength)
    shading /= shading[inplane].mean()
    return shading.astype(np.float32)[None]
