"""Decisions stay inside the encoding limits the header announces (partial Fourier, an off-centre
centre line): a policy is offered only the lines the scanner has (regression: a decision mapped to
line -4..-1 and ended the stream, or named lines outside the limits)."""

import ismrmrd
import numpy as np
import pytest

from masc_gadget.mrd.feedback import decision_from_acquisition, is_feedback
from masc_gadget.mrd.header import encoding_geometry, parse_header
from masc_gadget.serving.gadget import process
from masc_gadget.serving.host import Host
from masc_gadget.serving.models import ModelCache
from masc_gadget.serving.settings import GadgetSettings

from tests.scanner_streams import base_header

N_PE, N_RO, FIRST, LAST, CENTRE = 32, 16, 8, 31, 12  # 24 lines acquired, the centre 4 lines off the middle


def _header() -> str:
    xml = base_header(N_PE, N_RO, (200.0, 200.0, 5.0), slices=1)
    old = f"<minimum>0</minimum><maximum>{N_PE - 1}</maximum><center>{N_PE // 2}</center>"
    assert old in xml
    return xml.replace(old, f"<minimum>{FIRST}</minimum><maximum>{LAST}</maximum><center>{CENTRE}</center>")


def _line(line: int) -> ismrmrd.Acquisition:
    rng = np.random.default_rng(line)
    acq = ismrmrd.Acquisition.from_array((rng.standard_normal((1, N_RO)) + 1j).astype(np.complex64))
    acq.idx.kspace_encode_step_1 = line
    return acq


@pytest.mark.parametrize("policy", ["center-out", "equispaced", "random"])
def test_every_decision_names_a_line_the_scanner_has(policy):
    header = parse_header(_header())
    first, last = encoding_geometry(header).acquirable_rows
    assert (first, last) == (FIRST + N_PE // 2 - CENTRE, N_PE - 1)  # lines 8..27 fit the grid
    sent, errors, asked = [], [], []

    def scanner():
        for line in (CENTRE - 1, CENTRE):  # the protocol's two initial lines, around the header's centre
            yield _line(line)
        while True:
            new = [decision_from_acquisition(x) for x in sent[len(asked):] if isinstance(x, ismrmrd.Acquisition)
                   and is_feedback(x)]
            asked.extend(sent[len(asked):])
            if not new:
                return
            for decision in new:
                yield _line(decision.line)

    settings = GadgetSettings(policy=policy, initial=2, budget=14, feedback="inband")
    process(scanner(), header, settings, sent.append, on_error=errors.append, host=Host(cache=ModelCache()))
    decided = [decision_from_acquisition(x).line for x in sent if isinstance(x, ismrmrd.Acquisition) and is_feedback(x)]
    images = [x for x in sent if isinstance(x, ismrmrd.Image)]
    assert not errors and len(decided) == 14 and images
    offset = N_PE // 2 - CENTRE  # grid row = line + offset
    assert all(FIRST <= line <= N_PE - 1 - offset for line in decided), decided  # lines 8..27
