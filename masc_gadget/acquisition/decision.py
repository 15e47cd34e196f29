"""The next-line decision record, shared by the acquisition engine and the feedback channels.

Standard library only, so that protocol code (:mod:`masc_gadget.mrd.feedback`, the simulated scanner)
can import it without torch, and the engine (:mod:`masc_gadget.acquisition.engine`) without ismrmrd or zmq.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """"Acquire PE line ``line`` of slice ``slice`` next" (DESIGN.md, "Next-line feedback")."""

    slice: int
    """Slice the decision is for (``idx.slice``)."""
    line: int
    """Phase-encoding line to acquire next (``idx.kspace_encode_step_1``), in [0, n_pe)."""
    step: int
    """Lines acquired after the initial ones when the decision was made (0 .. budget - 1):
    the policy's step index."""
    latency_us: int
    """Wall time of the decision pass that produced it, microseconds (the same for every
    decision of one batched pass)."""
