"""What the MRD wire tests send: headers, messages of every kind, Gadgetron's own frames, and
how two messages are compared."""

from __future__ import annotations

import io
import socket

import ismrmrd
import numpy as np

HEADER_XML = (
    '<?xml version="1.0"?><ismrmrdHeader xmlns="http://www.ismrm.org/ISMRMRD">'
    "<experimentalConditions><H1resonanceFrequency_Hz>63500000</H1resonanceFrequency_Hz>"
    "</experimentalConditions><encoding><encodedSpace><matrixSize><x>64</x><y>64</y><z>1</z>"
    "</matrixSize><fieldOfView_mm><x>200</x><y>200</y><z>5</z></fieldOfView_mm></encodedSpace>"
    "<reconSpace><matrixSize><x>64</x><y>64</y><z>1</z></matrixSize><fieldOfView_mm><x>200</x>"
    "<y>200</y><z>5</z></fieldOfView_mm></reconSpace><encodingLimits/>"
    "<trajectory>cartesian</trajectory></encoding></ismrmrdHeader>"
)
CONFIG_XML = '<?xml version="1.0"?><configuration><property name="budget" value="18"/></configuration>'

IMAGE_DTYPES = [np.uint16, np.int16, np.uint32, np.float32, np.float64, np.complex64, np.complex128]


def make_acquisition(seed: int = 0, samples: int = 16, channels: int = 2, dims: int = 2):
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal((channels, samples)) + 1j * rng.standard_normal((channels, samples)))
    trajectory = rng.standard_normal((samples, dims)).astype(np.float32)
    acq = ismrmrd.Acquisition.from_array(data.astype(np.complex64), trajectory)
    acq.set_flag(ismrmrd.ACQ_USER1)
    acq.set_flag(ismrmrd.ACQ_LAST_IN_SLICE)
    acq.idx.kspace_encode_step_1 = 100 + seed
    acq.idx.slice = 3
    acq.user_int[0] = seed
    acq.user_int[1] = -12345
    acq.user_float[7] = 0.5
    acq.scan_counter = 7 + seed
    acq.measurement_uid = 99
    acq.sample_time_us = 2.5
    acq.center_sample = samples // 2
    acq.position[:] = (1.0, -2.0, 3.5)
    acq.read_dir[:] = (1.0, 0.0, 0.0)
    acq.channel_mask[0] = 0b11
    return acq


def make_image(dtype=np.float32, meta: bool = True, shape=(2, 1, 5, 6)):
    rng = np.random.default_rng(1)
    values = rng.standard_normal(shape) * 100
    if np.issubdtype(dtype, np.complexfloating):
        values = values + 1j * rng.standard_normal(shape)
    if np.issubdtype(dtype, np.unsignedinteger):
        values = np.abs(values)
    image = ismrmrd.Image.from_array(values.astype(dtype))
    image.image_index = 4
    image.image_series_index = 2
    image.slice = 3
    image.field_of_view[:] = (200.0, 200.0, 5.0)
    image.image_type = ismrmrd.IMTYPE_MAGNITUDE
    image.user_int[2] = 77
    if meta:
        image.meta = ismrmrd.Meta(
            {"acquired_lines": ["31", "32", "7"], "policy": "masc-ppo v1", "unicode": "Ø µ"}
        )
    return image


def make_waveform(samples: int = 10, channels: int = 3):
    data = np.arange(channels * samples, dtype=np.uint32).reshape(channels, samples) * 3 + 1
    waveform = ismrmrd.Waveform.from_array(data)
    waveform.waveform_id = 1
    waveform.time_stamp = 123456
    waveform.sample_time_us = 2.5
    return waveform


def header_bytes(obj) -> bytes:
    return bytes(obj.getHead())


class Sink:
    """A fake gadgetron destination: ``.write`` collects bytes."""

    def __init__(self):
        self.buffer = io.BytesIO()

    def write(self, data):
        self.buffer.write(data)

    def getvalue(self) -> bytes:
        return self.buffer.getvalue()


class Source:
    """A fake gadgetron source: ``.read`` over a BytesIO."""

    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)

    def read(self, n: int) -> bytes:
        return self.buffer.read(n)


def gadgetron_frame(write, item) -> bytes:
    sink = Sink()
    write(sink, item)
    return sink.getvalue()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def assert_acquisitions_equal(got, want):
    assert isinstance(got, ismrmrd.Acquisition)
    assert header_bytes(got) == header_bytes(want)
    np.testing.assert_array_equal(got.data, want.data)
    np.testing.assert_array_equal(got.traj, want.traj)
    assert got.data.dtype == np.complex64 and got.traj.dtype == np.float32
    assert got == want


def assert_images_equal(got, want):
    assert isinstance(got, ismrmrd.Image)
    assert header_bytes(got) == header_bytes(want)
    assert got.data.dtype == want.data.dtype
    np.testing.assert_array_equal(got.data, want.data)
    assert dict(got.meta) == dict(want.meta)
    assert got == want
