"""Sequence and geometry of the simulated TSE scan (config section ``sequence``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GAMMA_BAR_HZ_PER_T = 42.577478518e6
"""Proton gyromagnetic ratio / 2 pi (CODATA 2018), Hz/T."""


@dataclass(frozen=True)
class SequenceConfig:
    """2D multi-slice turbo spin echo, axial slices, readout along x (L-R), PE along y (A-P)."""

    b0_t: float = 3.0
    """Main field strength, tesla (paper: 3 T)."""
    tr_ms: float = 4050.0
    """Repetition time, ms (paper: 4050)."""
    te_ms: float = 32.0
    """Effective echo time, ms (paper: 32)."""
    echo_train_length: int = 16
    """Echoes per excitation; only written to the header (T2 blurring is not simulated)."""
    readout_bw_hz_per_px: float = 710.0
    """Receiver bandwidth per pixel along the readout, Hz/pixel (paper: 710)."""
    rf_bw_hz: float = 1000.0
    """Bandwidth of the slice-selective excitation / refocusing pulses, Hz (paper: 1 kHz)."""
    slice_thickness_mm: float = 3.0
    """Nominal slice thickness, mm (paper: 3)."""
    slice_gap_mm: float = 0.0
    """Gap between adjacent slices, mm."""
    n_slices: int = 36
    """Number of axial slices in the stack (paper: 36)."""
    matrix: tuple[int, int] = (200, 200)
    """Acquisition matrix (readout, phase encoding); ~200 PE lines makes 2 + 18 lines 10x."""
    fov_mm: tuple[float, float] = (300.0, 300.0)
    """Field of view (readout, phase encoding), mm."""
    fov_centre: Literal["hip", "pelvis"] = "hip"
    """Centre the in-plane FOV on the implanted hip joint ("hip") or on the pelvis ("pelvis")."""
    slab_offset_mm: float = -30.0
    """Centre of the slice stack relative to the implanted femoral head centre, along z (mm);
    negative moves the stack down the femoral stem."""

    def __post_init__(self) -> None:
        if self.b0_t <= 0:
            raise ValueError(f"b0_t must be > 0 tesla, got {self.b0_t}")
        if not 0 < self.te_ms < self.tr_ms:
            raise ValueError(f"need 0 < te_ms < tr_ms, got te_ms={self.te_ms}, tr_ms={self.tr_ms}")
        for name in ("readout_bw_hz_per_px", "rf_bw_hz", "slice_thickness_mm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.slice_gap_mm < 0:
            raise ValueError(f"slice_gap_mm must be >= 0, got {self.slice_gap_mm}")
        if self.n_slices < 1:
            raise ValueError(f"n_slices must be >= 1, got {self.n_slices}")
        if min(self.matrix) < 8 or any(m % 2 for m in self.matrix):
            raise ValueError(f"matrix sizes must be even and >= 8, got {list(self.matrix)}")
        if min(self.fov_mm) <= 0:
            raise ValueError(f"fov_mm must be > 0, got {list(self.fov_mm)}")

    @property
    def n_readout(self) -> int:
        return self.matrix[0]

    @property
    def n_pe(self) -> int:
        return self.matrix[1]

    @property
    def pixel_mm(self) -> tuple[float, float]:
        """Reconstructed pixel size (readout, PE), mm."""
        return (self.fov_mm[0] / self.matrix[0], self.fov_mm[1] / self.matrix[1])

    @property
    def slice_spacing_mm(self) -> float:
        return self.slice_thickness_mm + self.slice_gap_mm

    @property
    def larmor_hz(self) -> float:
        return GAMMA_BAR_HZ_PER_T * self.b0_t

    @property
    def dwell_time_us(self) -> float:
        """ADC dwell time: 1 / (bandwidth per pixel * readout samples), microseconds."""
        return 1e6 / (self.readout_bw_hz_per_px * self.matrix[0])

    def slice_offsets_mm(self) -> list[float]:
        """Slice centre offsets from the stack centre along z, inferior to superior."""
        n = self.n_slices
        return [(i - (n - 1) / 2) * self.slice_spacing_mm for i in range(n)]
