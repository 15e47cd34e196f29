"""The headroom of adaptive line choice: how far the oracle leads the best fixed order.

An adaptive policy can only beat a fixed line order by what a per-slice choice adds over the best
order a population allows. ``masc check headroom`` (and ``masc check headroom``) measures that lead on
a data set before anyone trains for it:

- **the fixed order, cross-fitted**: the subjects are split into ``folds`` folds; for each fold,
  the population-greedy order (:func:`training.population.population_order`) is fitted on the
  other folds' slices and played on this fold's. No slice is scored by an order fitted on it, so
  the order pays what a refit on a new population pays, and nothing more. With ``fit_split``
  (``train``), one order is fitted on that split instead, the order a deployment ships.
- **the oracle**: per slice, with the clean image, the greedy one-step oracle, or with ``beam``
  > 1 a beam search that keeps the greedy path (:class:`training.oracle.BeamOracle`): a yardstick,
  not a bound on what a policy can reach.
- **centre-out**, the conventional order, for scale.

All three acquire the protocol's ``initial + budget`` lines (section ``acquisition``) under one
MAR network, choose to maximise ``Q`` in the chosen region (``region: image``, or ``implant``:
the periprosthetic region, the implant dilated by ``margin`` pixels, a radiologist's reading
area) and are scored on the served MAR image (:func:`masc_gadget.core.served.served_images`,
without the OOD fallback: a line choice is compared, not a fallback rule). The lead ``oracle -
fixed`` is tested over subjects (:func:`training.evaluation.stats.subject_tests`). With several
MAR networks (``--mar A,B,C``, e.g. three training seeds) each is measured apart, and the
report gives the mean and spread of the lead and a test on the subjects' leads averaged over the
networks. With ``corruption`` (its probability > 0), each acquisition of a line is corrupted with that probability
(:mod:`training.rl.corruption`, ``motion`` or ``spike``): the fixed order and centre-out
play their lines' first acquisitions, and the oracle may also acquire a line again. With ``recon:
sense`` the lines are reconstructed with ``coils`` receive coils by CG-SENSE
(:mod:`training.evaluation.sense`) and scored without a MAR network (none is trained on such
images), so that coil encoding can make lines redundant slice by slice. The gate: a lead over
the better fixed order (the fitted one, or centre-out) below ``gate`` (0.03 SSIM) says a fixed
order refit per population is the method to deploy there, and an adaptive policy is not worth
training for it. ``policy_paths`` adds learned policies, judged by the share of that lead they
capture.

Reports are typed (:mod:`training.evaluation.headroom.types`: :class:`HeadroomReport` of one
:class:`HeadroomRun` per network, to and from ``headroom.json``).
"""

from training.data import REGIONS
from training.evaluation.headroom.config import METHODS, RECONS, HeadroomConfig, measured_slices
from training.evaluation.headroom.measure import add_policies, headroom
from training.evaluation.headroom.report import (describe, read_headroom, render_candidates, render_headroom,
                                                  write_headroom)
from training.evaluation.headroom.summary import summarise
from training.evaluation.headroom.types import HeadroomReport, HeadroomRun
from training.evaluation.stats import subject_folds

__all__ = ["HeadroomConfig", "HeadroomReport", "HeadroomRun", "METHODS", "RECONS", "REGIONS", "add_policies",
           "describe", "headroom", "measured_slices", "read_headroom", "render_candidates",
           "render_headroom", "subject_folds", "summarise", "write_headroom"]
