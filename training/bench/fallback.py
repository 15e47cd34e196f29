"""``masc bench fallback``: what the OOD rule's safety net costs per slice.

The early switch (:mod:`masc_gadget.core.ood`) runs inside the decision pass of a policy that
reads the MAR image: the zero-filled image and the MAR output of the initial lines are there
already, and the rule adds its score, the comparison with the threshold, centre-out's next line
for a switched slice and, at the end, the zero-filled image served in place of the MAR one. The
end-of-scan rule adds its score to the final reconstruction. Each is timed on its own for one
slice (batch 1, the worst case per slice), beside the zero-filled reconstruction and MAR pass the
gadget runs anyway, so the ratio is read from one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from masc_gadget.acquisition.episode import AcquisitionState
from masc_gadget.acquisition.policies import SAFE_ORDER
from masc_gadget.core.kspace import fft2c, zero_filled
from masc_gadget.core.ood import EARLY_SCORES, SCORES, OodCalibration, early_switch, initial_of, ood_score
from masc_gadget.core.served import served_images
from training.bench.common import percentile_of

TARGET_MS = 20.0
"""The most the safety net may cost per 128 x 128 slice on one core (issue: never worse than
doing nothing)."""


def _time(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": percentile_of(times, 50), "p90_ms": percentile_of(times, 90)}


@torch.no_grad()
def bench_fallback(mar: torch.nn.Module, size: int, initial: int, repeats: int = 50, seed: int = 0
                   ) -> list[dict[str, Any]]:
    """Rows of per-slice latencies (median, p90 in ms) on one ``size`` x ``size`` slice with
    ``initial`` centre lines: the reconstruction and MAR pass the decision already runs, then
    each score of the early switch (score, threshold, centre-out's line, the served image) and
    of the end-of-scan rule."""
    gen = torch.Generator().manual_seed(seed)
    image = torch.rand(1, size, size, generator=gen)
    kspace = fft2c(image.to(torch.complex64))
    mask = torch.zeros(1, size, dtype=torch.bool)
    mask[:, size // 2 - initial // 2: size // 2 - initial // 2 + initial] = True
    zf = zero_filled(kspace, mask)
    corrected = mar(zf)
    state = AcquisitionState.initial(size, initial, 1)
    rows = [{"step": "zero-filled + MAR pass (run anyway)", "score": "-",
             **_time(lambda: mar(zero_filled(kspace, mask)), repeats)}]
    later = mask.clone()  # holdout and halves score a slice with lines beyond the initial ones: 4 more
    later[:, torch.arange(0, size, max(1, size // 4))[:4]] = True
    zf_later = zero_filled(kspace, later)
    corrected_later = mar(zf_later)
    for kind in EARLY_SCORES:
        def early(kind: str = kind) -> None:
            rule = OodCalibration(kind, 1e-12, "early", None if kind in SCORES else initial + 4)  # all flagged
            if kind in SCORES:
                flagged, score = early_switch(rule, zf, corrected, mask, mar)
            else:  # its initial lines' image is made here, part of what it costs
                flagged, score = early_switch(rule, zf_later, corrected_later, later, mar,
                                              initial_of(rule, kspace, initial, later))
            SAFE_ORDER.select(state)
            served_images(zf, corrected, ood=rule, mask=mask, switched=flagged, early_score=score)

        rows.append({"step": "early switch", "score": kind, **_time(early, repeats)})
        if kind not in SCORES:  # an early rule's score only
            continue

        def end(kind: str = kind) -> None:
            served_images(zf, corrected, ood=OodCalibration(kind, 1e-12), mask=mask, mar=mar)

        rows.append({"step": "end-of-scan rule", "score": kind, **_time(end, repeats)})
        rows.append({"step": "score alone", "score": kind,
                     **_time(lambda kind=kind: ood_score(kind, zf, corrected, mask, mar), repeats)})
    for row in rows[1:]:
        row["within_target"] = row["median_ms"] <= TARGET_MS
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| step | score | median ms | p90 ms | within 20 ms |", "| --- | --- | ---: | ---: | --- |"]
    for r in rows:
        ok = "-" if "within_target" not in r else ("yes" if r["within_target"] else "NO")
        lines.append(f"| {r['step']} | {r['score']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {ok} |")
    return "\n".join(lines)


__all__ = ["TARGET_MS", "bench_fallback", "format_table"]
