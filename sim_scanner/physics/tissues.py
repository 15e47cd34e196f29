"""Tissue labels of the phantoms, and their MR properties.

The label values are stored in datasets; never renumber them.

Relaxation times are tabulated at 1.5 T and 3 T from the literature (rounded; the source of each
row is given next to it) and carried to other field strengths by :func:`tissue_properties`:
T1 with a power law in B0 through the two tabulated points (the field dependence that Rooney et
al. fit to in-vivo data, MRM 2007;57:308-318), T2 linearly, clamped to stay positive.

Susceptibilities are volume susceptibilities in ppm (SI), as used by the simulator the MASC paper
follows (Zochowski et al. 2024; values after Schenck, Med Phys 1996;23:815-850): water and soft
tissue -9.05, cortical bone -8.86, fat -5.55, air +0.36. Marrow is a fat / water mix by volume.

References (values rounded from their tables):

* Gold GE et al. Musculoskeletal MRI at 3.0 T: relaxation times and image contrast.
  AJR 2004;183:343-351 (knee: cartilage, muscle, synovial fluid, marrow, subcutaneous fat).
* Stanisz GJ et al. T1, T2 relaxation and magnetization transfer in tissue at 3T.
  MRM 2005;54:507-512 (1.5 T and 3 T: muscle, cartilage, blood ...).
* Bojorquez JZ et al. What are normal relaxation times of tissues at 3 T?
  MRI 2017;35:69-80 (review; 3 T ranges used to sanity-check every 3 T entry).
* Rooney WD et al. Magnetic field and tissue dependencies of human brain longitudinal 1H2O
  relaxation in vivo. MRM 2007;57:308-318 (power-law field dependence of T1).
* Du J, Bydder GM. Qualitative and quantitative ultrashort-TE MRI of cortical bone.
  NMR Biomed 2013;26:489-506; Chang EY, Du J, Chung CB. UTE imaging in the musculoskeletal
  system. JMRI 2015;41:870-883: T2* below 1 ms (cortical bone) and a few ms (tendon), i.e. no
  signal at turbo-spin-echo echo times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum


class Tissue(IntEnum):
    AIR = 0
    SKIN = 1
    FAT = 2
    MUSCLE = 3
    CORTICAL_BONE = 4
    YELLOW_MARROW = 5
    RED_MARROW = 6
    CARTILAGE = 7
    SYNOVIAL_FLUID = 8
    URINE = 9
    BLOOD = 10
    BOWEL = 11
    TENDON = 12
    IMPLANT = 15


@dataclass(frozen=True)
class TissueProperties:
    """MR properties of one tissue at one field strength."""

    pd: float
    """Proton density relative to pure water (0..1)."""
    t1_ms: float
    """Longitudinal relaxation time, ms."""
    t2_ms: float
    """Transverse relaxation time, ms."""
    chi_ppm: float
    """Volume magnetic susceptibility, ppm (SI)."""


CHI_WATER_PPM = -9.05
"""Water and water-like soft tissue (Schenck 1996; the MASC paper)."""
CHI_CORTICAL_BONE_PPM = -8.86
CHI_FAT_PPM = -5.55
CHI_AIR_PPM = 0.36


def _fat_water_chi(fat_fraction: float) -> float:
    """Susceptibility of a fat / water mix with the given fat volume fraction."""
    return fat_fraction * CHI_FAT_PPM + (1.0 - fat_fraction) * CHI_WATER_PPM


RED_MARROW_FAT_FRACTION = 0.4
"""Adult haematopoietic (red) marrow of the proximal femur / pelvis: ~40 % fat."""
YELLOW_MARROW_FAT_FRACTION = 0.8
"""Adult fatty (yellow) marrow of the femoral diaphysis: ~80 % fat."""

# tissue: (pd, (T1 1.5 T, T1 3 T) ms, (T2 1.5 T, T2 3 T) ms, chi ppm)
_TABLE: dict[Tissue, tuple[float, tuple[float, float], tuple[float, float], float]] = {
    # No signal (pd 0); T1 / T2 are placeholders that keep every formula finite.
    Tissue.AIR: (0.0, (1000.0, 1000.0), (1.0, 1.0), CHI_AIR_PPM),
    # Dermis: approximate (Richard S et al., J Invest Dermatol 1991;97:120, 1.5 T);
    # the 3 T values follow the muscle-like field dependence.
    Tissue.SKIN: (0.7, (900.0, 1150.0), (40.0, 35.0), CHI_WATER_PPM),
    # Subcutaneous fat: Gold 2004 (T1 288 / 371 ms, T2 165 / 133 ms; Bojorquez 2017 ~370 ms).
    Tissue.FAT: (0.9, (288.0, 371.0), (165.0, 133.0), CHI_FAT_PPM),
    # Skeletal muscle: Gold 2004 (T1 1130 / 1420 ms, T2 35 / 32 ms); Stanisz 2005 report
    # 1008 / 1412 ms and 44 / 50 ms.
    Tissue.MUSCLE: (0.8, (1130.0, 1420.0), (35.0, 32.0), CHI_WATER_PPM),
    # Cortical bone: bound water, T2* ~0.3-0.5 ms (Du and Bydder 2013); T1 ~140-250 ms. Very low
    # visible proton density: no signal in a turbo spin echo.
    Tissue.CORTICAL_BONE: (0.05, (180.0, 240.0), (1.0, 0.8), CHI_CORTICAL_BONE_PPM),
    # Fatty marrow: close to fat (80 % fat); T1 from Gold 2004 fat, T2 slightly shorter.
    Tissue.YELLOW_MARROW: (0.9, (300.0, 380.0), (140.0, 120.0),
                           _fat_water_chi(YELLOW_MARROW_FAT_FRACTION)),
    # Marrow (mixed): Gold 2004 "bone marrow" (T1 549 / 586 ms, T2 49 / 49 ms).
    Tissue.RED_MARROW: (0.8, (549.0, 586.0), (49.0, 49.0),
                        _fat_water_chi(RED_MARROW_FAT_FRACTION)),
    # Hyaline cartilage: Gold 2004 (T1 1060 / 1240 ms, T2 42 / 37 ms); Stanisz 2005
    # 1024 / 1168 ms, 30 / 27 ms.
    Tissue.CARTILAGE: (0.75, (1060.0, 1240.0), (42.0, 37.0), CHI_WATER_PPM),
    # Synovial fluid: Gold 2004 (T1 2850 / 3620 ms, T2 1210 / 767 ms).
    Tissue.SYNOVIAL_FLUID: (0.95, (2850.0, 3620.0), (1210.0, 767.0), CHI_WATER_PPM),
    # Urine: dilute water; approximate, between synovial fluid and CSF (Bojorquez 2017:
    # CSF T1 ~4000 ms at 3 T); shortened by solutes.
    Tissue.URINE: (0.98, (2500.0, 3000.0), (900.0, 750.0), CHI_WATER_PPM),
    # Whole blood: Stanisz 2005 (T1 1441 / 1932 ms, T2 290 / 275 ms). Flow voids are not
    # modelled: vessels carry static-blood contrast.
    Tissue.BLOOD: (0.85, (1441.0, 1932.0), (290.0, 275.0), CHI_WATER_PPM),
    # Bowel (wall and contents, no gas): generic abdominal soft tissue, approximate
    # (within the 3 T ranges compiled by Bojorquez 2017).
    Tissue.BOWEL: (0.8, (900.0, 1200.0), (70.0, 60.0), CHI_WATER_PPM),
    # Tendon / ligament: short T2 (a few ms, Chang et al. 2015), no TSE signal.
    Tissue.TENDON: (0.1, (600.0, 720.0), (5.0, 4.0), CHI_WATER_PPM),
    # Placeholder for voxels the implant occupies: no protons; its own susceptibility is
    # applied by the implant model, so the background here is water-like.
    Tissue.IMPLANT: (0.0, (1000.0, 1000.0), (1.0, 1.0), CHI_WATER_PPM),
}

_B0_LOW_T = 1.5
_B0_HIGH_T = 3.0
_T2_FLOOR_FRACTION = 0.2
"""Extrapolated T2 never drops below this fraction of the smaller tabulated value."""


def _t1_at(b0_t: float, t1_low: float, t1_high: float) -> float:
    """Power law T1 = T1(1.5 T) * (B0 / 1.5 T) ** beta through both tabulated points."""
    if b0_t == _B0_HIGH_T:
        return t1_high
    beta = math.log(t1_high / t1_low) / math.log(_B0_HIGH_T / _B0_LOW_T)
    return t1_low * (b0_t / _B0_LOW_T) ** beta


def _t2_at(b0_t: float, t2_low: float, t2_high: float) -> float:
    """Linear in B0 through both tabulated points, clamped positive."""
    t2 = t2_low + (t2_high - t2_low) * (b0_t - _B0_LOW_T) / (_B0_HIGH_T - _B0_LOW_T)
    return max(t2, _T2_FLOOR_FRACTION * min(t2_low, t2_high))


def tissue_properties(b0_t: float) -> dict[Tissue, TissueProperties]:
    """MR properties of every :class:`Tissue` at field strength ``b0_t`` (tesla).

    Exact table values at 1.5 T and 3 T; T1 follows a power law in B0 and T2 a straight line
    (clamped to stay positive) elsewhere. Proton density and susceptibility do not depend on B0.
    """
    if not b0_t > 0:
        raise ValueError(f"b0_t must be > 0 tesla, got {b0_t}")
    out: dict[Tissue, TissueProperties] = {}
    for tissue, (pd, (t1_low, t1_high), (t2_low, t2_high), chi) in _TABLE.items():
        out[tissue] = TissueProperties(
            pd=pd,
            t1_ms=_t1_at(b0_t, t1_low, t1_high),
            t2_ms=_t2_at(b0_t, t2_low, t2_high),
            chi_ppm=chi,
        )
    return out
