"""Next-line feedback: in-band acquisitions survive ISMRMRD serialisation, JSON round-trips, and
the ZeroMQ side channel delivers decisions and never blocks the gadget."""

import io
import json
import socket
import subprocess
import sys
import time

import ismrmrd
import numpy as np
import pytest

from masc_gadget.acquisition.decision import Decision
from masc_gadget.mrd.feedback import (
    ZmqFeedback,
    ZmqFeedbackReceiver,
    decision_from_acquisition,
    decision_from_json,
    decision_json,
    feedback_acquisition,
    is_feedback,
)

DECISION = Decision(slice=3, line=17, step=4, latency_us=1234)


def serialised_round_trip(acq):
    stream = io.BytesIO()
    acq.serialize_into(stream.write)
    size = stream.tell()
    stream.seek(0)
    back = ismrmrd.Acquisition.deserialize_from(stream.read)
    assert stream.tell() == size  # nothing left over: the reader consumed exactly the message
    return back, size


def data_acquisition():
    """A 2-channel, 16-sample acquisition of slice 9, line 5, with geometry and idx fields."""
    data = (np.arange(32).reshape(2, 16) * (1 + 1j)).astype(np.complex64)
    acq = ismrmrd.Acquisition.from_array(data)
    acq.measurement_uid = 77
    acq.scan_counter = 12
    acq.acquisition_time_stamp = 123456
    acq.physiology_time_stamp[0] = 42
    acq.sample_time_us = 5.0
    acq.center_sample = 8
    acq.encoding_space_ref = 0
    acq.position[:] = (1.0, 2.0, 3.0)
    acq.read_dir[:] = (0.0, 1.0, 0.0)
    acq.phase_dir[:] = (1.0, 0.0, 0.0)
    acq.slice_dir[:] = (0.0, 0.0, 1.0)
    acq.patient_table_position[:] = (0.0, 0.0, -10.0)
    idx = acq.idx
    idx.kspace_encode_step_1, idx.slice = 5, 9
    idx.contrast, idx.repetition, idx.set, idx.phase, idx.average, idx.segment = 1, 2, 3, 4, 5, 6
    idx.user[0] = 8
    acq.user_int[5] = 99
    acq.user_float[0] = 2.5
    acq.set_flag(ismrmrd.ACQ_FIRST_IN_SLICE)
    acq.set_flag(ismrmrd.ACQ_LAST_IN_SLICE)
    return acq


# --- in-band ---------------------------------------------------------------------------------------


def test_in_band_feedback_round_trips_through_ismrmrd_serialisation():
    acq = feedback_acquisition(DECISION)
    assert acq.number_of_samples == 0 and acq.data.size == 0 and acq.traj.size == 0
    assert acq.active_channels == 1 and acq.available_channels == 1  # ISMRMRD's empty defaults
    assert acq.flags == 1 << (ismrmrd.ACQ_USER1 - 1)  # ACQ_USER1 only
    back, size = serialised_round_trip(acq)
    assert size == len(bytes(ismrmrd.AcquisitionHeader()))  # header only, no payload
    assert is_feedback(back)
    assert decision_from_acquisition(back) == DECISION
    assert back.idx.kspace_encode_step_1 == 17 and back.idx.slice == 3
    assert back.user_int[0] == 4 and back.user_int[1] == 1234
    assert back.version == 1


def test_in_band_feedback_copies_the_template():
    template = data_acquisition()
    before = template.to_bytes()
    for source in (template, template.getHead()):
        back, _ = serialised_round_trip(feedback_acquisition(DECISION, source))
        assert decision_from_acquisition(back) == DECISION
        idx = back.idx
        assert (idx.contrast, idx.repetition, idx.set, idx.phase, idx.average, idx.segment) == (
            1, 2, 3, 4, 5, 6)
        assert idx.user[0] == 8
        assert (idx.kspace_encode_step_1, idx.slice) == (17, 3)  # the decision's, not the template's
        assert back.measurement_uid == 77 and back.scan_counter == 12
        assert back.acquisition_time_stamp == 123456 and back.physiology_time_stamp[0] == 42
        assert list(back.position) == [1.0, 2.0, 3.0]
        assert list(back.read_dir) == [0.0, 1.0, 0.0]
        assert list(back.phase_dir) == [1.0, 0.0, 0.0]
        assert list(back.slice_dir) == [0.0, 0.0, 1.0]
        assert list(back.patient_table_position) == [0.0, 0.0, -10.0]
        # not copied: samples, flags, user values of the template
        assert back.number_of_samples == 0 and back.data.size == 0 and back.center_sample == 0
        assert back.flags == 1 << (ismrmrd.ACQ_USER1 - 1)
        assert not back.is_flag_set(ismrmrd.ACQ_LAST_IN_SLICE)
        assert back.user_int[5] == 0 and back.user_float[0] == 0.0
    assert template.to_bytes() == before  # the template is not modified


def test_is_feedback_needs_the_flag_and_no_samples():
    data = data_acquisition()
    assert not is_feedback(data)
    data.set_flag(ismrmrd.ACQ_USER1)
    assert not is_feedback(data)  # samples: a data line that happens to carry USER1
    assert not is_feedback(ismrmrd.Acquisition())  # no flag
    assert is_feedback(feedback_acquisition(DECISION).getHead())
    with pytest.raises(ValueError, match="not a next-line feedback acquisition"):
        decision_from_acquisition(data)


def test_in_band_limits():
    acq = feedback_acquisition(Decision(slice=0, line=0, step=0, latency_us=2**40))
    assert acq.user_int[1] == 2**31 - 1  # clamped to int32
    with pytest.raises(ValueError, match="line must be in"):
        feedback_acquisition(Decision(slice=0, line=70000, step=0, latency_us=0))
    with pytest.raises(ValueError, match="slice must be in"):
        feedback_acquisition(Decision(slice=-1, line=0, step=0, latency_us=0))
    with pytest.raises(ValueError, match="step must be an integer"):
        feedback_acquisition(Decision(slice=0, line=0, step=1.5, latency_us=0))
    assert decision_from_acquisition(
        feedback_acquisition(Decision(slice=np.int64(2), line=np.int16(3), step=0, latency_us=0))
    ) == Decision(2, 3, 0, 0)


# --- JSON ------------------------------------------------------------------------------------------


def test_json_round_trip():
    text = decision_json(DECISION)
    payload = json.loads(text)
    assert set(payload) == {"slice", "line", "step", "latency_us", "t"}
    assert abs(payload["t"] - time.time()) < 5
    assert decision_from_json(text) == DECISION
    assert decision_from_json(text.encode()) == DECISION


@pytest.mark.parametrize("field", ["slice", "line", "step", "latency_us"])
def test_json_missing_field_is_named(field):
    payload = json.loads(decision_json(DECISION))
    del payload[field]
    with pytest.raises(ValueError, match=f"no '{field}' field"):
        decision_from_json(json.dumps(payload))


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"slice": 1, "line": "2", "step": 0, "latency_us": 0}', "'line' must be an integer"),
        ('{"slice": 1, "line": 2, "step": true, "latency_us": 0}', "'step' must be an integer"),
        ("[1, 2, 3, 4]", "must be a JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_json_bad_values(text, match):
    with pytest.raises(ValueError, match=match):
        decision_from_json(text)


# --- ZeroMQ side channel ---------------------------------------------------------------------------


def test_zmq_delivers_decisions_in_order():
    with ZmqFeedbackReceiver("tcp://127.0.0.1:*") as receiver:
        assert receiver.endpoint.startswith("tcp://127.0.0.1:")
        with ZmqFeedback(receiver.endpoint) as sender:
            sent = [Decision(slice=s, line=10 + s, step=s, latency_us=100 * s) for s in range(10)]
            assert all(sender.send(d) for d in sent)
            got = [receiver.receive(timeout_ms=2000) for _ in sent]
            assert got == sent
            assert sender.sent == 10 and sender.dropped == 0
            start = time.perf_counter()
            assert receiver.receive(timeout_ms=50) is None
            assert time.perf_counter() - start < 1.0


def free_tcp_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zmq_send_never_blocks_without_a_receiver():
    sender = ZmqFeedback(f"tcp://127.0.0.1:{free_tcp_port()}", hwm=100)
    start = time.perf_counter()
    results = [sender.send(Decision(slice=0, line=i % 16, step=0, latency_us=0)) for i in range(2000)]
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0  # a loose sanity bound: NOBLOCK, nothing waits for a peer
    assert sender.sent + sender.dropped == 2000 and sender.dropped > 0
    assert results.count(False) == sender.dropped
    sender.close()
    sender.close()  # idempotent
    assert sender.send(DECISION) is False  # after close: dropped, not raised


def test_zmq_receiver_rejects_garbage():
    import zmq

    with ZmqFeedbackReceiver("tcp://127.0.0.1:*") as receiver:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(receiver.endpoint)
        push.send(b'{"slice": 1}')
        with pytest.raises(ValueError, match="no 'line' field"):
            receiver.receive(timeout_ms=2000)
        push.close()


def test_zmq_bad_addresses():
    with pytest.raises(ValueError, match="ZeroMQ endpoint"):
        ZmqFeedback("127.0.0.1:5555")
    with pytest.raises(ValueError, match="hwm"):
        ZmqFeedback("tcp://127.0.0.1:5555", hwm=0)
    with ZmqFeedbackReceiver("tcp://127.0.0.1:*") as receiver, \
            pytest.raises(ValueError, match="cannot bind"):
        ZmqFeedbackReceiver(receiver.endpoint)  # address in use


def test_feedback_imports_no_torch():
    code = "import sys, masc_gadget.mrd.feedback; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
