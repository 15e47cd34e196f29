"""Procedural 3D pelvis / proximal-femur phantoms with per-subject anatomical variation.

Two phases, so that the scan geometry can depend on the anatomy before anything is rasterised:

1. :func:`draw_anatomy` draws every per-subject parameter from a seeded generator and returns
   an :class:`Anatomy` (parameters + landmarks such as the hip joints);
2. :func:`rasterize_anatomy` turns it into a label volume on any :class:`~sim_scanner.physics.grid.Grid`,
   and :func:`tissue_maps` into proton density, T1, T2 and susceptibility maps.

Coordinates follow :mod:`sim_scanner.physics.grid` (mm, LPS, volumes [z, y, x]); z = 0 is the level of
the femoral head centres, x = 0 the mid-sagittal plane, y = 0 the middle of the body's
antero-posterior extent at that level.

How the volume is built
-----------------------
Every structure is an implicit shape (an approximate signed distance in mm, negative inside)
evaluated on voxel centres, and the labels are painted from the outside in: air, skin,
subcutaneous fat, muscle groups, the pelvic cavity with its organs, vessels, then bones and the
hip joints. Muscle groups are a labelled Voronoi partition of the space inside the fat: each
group is a chain of tapered capsules that reaches at most ``margin`` mm past them, every voxel
goes to the nearest group, and voxels almost equally near two groups (or at the end of a
group's reach) become the thin fat planes that separate muscles on MR images.

Structures: body outline (one trunk section down to the perineum, two thighs below it), skin,
subcutaneous fat (thicker over the buttocks), about 20 muscle groups per side, iliotibial band;
pelvic cavity fat with bladder (urine, detrusor wall), rectum / anal canal, sigmoid and small
bowel loops, levator ani; external iliac / femoral artery and vein, deep femoral artery; ilium
wing, acetabulum, posterior column, ischium, pubic rami and body, sacrum, coccyx, lumbar bodies
and discs, symphysis and sacro-iliac cartilage; femoral head, neck, trochanters and shaft
(cortex of drawn thickness, red marrow proximally, yellow marrow in the diaphyseal canal),
articular cartilage on head and socket with a synovial fluid film, acetabular fossa fat,
labrum, joint capsule. Above the pelvis the trunk and below the hips the thighs simply continue.
Not modelled: prostate / uterus, nerves, flow voids. Bowel gas is optional (``bowel_gas_fraction``).

Soft tissue (outline, fat, muscles, organs, vessels) is evaluated at smoothly warped coordinates
``p + u(p)``, ``u`` a sum of a few random low-frequency plane waves defined in mm (so it does
not depend on the grid). Bones and joints are not warped, so the :class:`HipJoint` landmarks
that the implant model is fitted to are exact.

The volume is rasterised in slabs of whole z planes (:meth:`Grid.zslab`), and inside a slab each
shape is evaluated only in its bounding box, so memory stays bounded on large grids and the
result does not depend on the slab size.

Modules
-------
``config``       :class:`PhantomConfig` (config section ``phantom``) and its validation
``records``      :class:`HipJoint`, :class:`Anatomy`, :func:`phantom_params`, :func:`turned_landmarks`
``anatomy``      :func:`draw_anatomy`: drawing the per-subject parameters
``skeleton``     pelvic frame, femur parts and the bone spheres the outline must contain
``shapes``       vector helpers, implicit shapes (signed distances) and world boxes
``texture``      smooth random fields: value-noise texture and the soft-tissue deformation
``muscles``      the muscle groups (chains of tapered capsules) of each side
``layout``       every point and profile the rasteriser paints, derived from an anatomy
``chunk``        one z slab being rasterised: axes, labels, warped coordinates
``soft_tissue``  painting body outline, fat, cavity, muscles, organs and vessels
``bones``        painting the pelvis, sacrum / lumbar column and hip joints
``rasterize``    :func:`rasterize_anatomy`: the slab loop and the painting order
``maps``         :class:`TissueMaps` and :func:`tissue_maps`

This package re-exports the public names, so ``from sim_scanner.physics.phantom import ...``
keeps working.
"""

from __future__ import annotations

from sim_scanner.physics.phantom.anatomy import draw_anatomy
from sim_scanner.physics.phantom.config import PhantomConfig
from sim_scanner.physics.phantom.maps import TissueMaps, tissue_maps
from sim_scanner.physics.phantom.rasterize import rasterize_anatomy
from sim_scanner.physics.phantom.records import (
    Anatomy,
    HipJoint,
    Vec3,
    phantom_params,
    turned_landmarks,
)

__all__ = [
    "Anatomy",
    "HipJoint",
    "PhantomConfig",
    "TissueMaps",
    "Vec3",
    "draw_anatomy",
    "phantom_params",
    "rasterize_anatomy",
    "tissue_maps",
    "turned_landmarks",
]
