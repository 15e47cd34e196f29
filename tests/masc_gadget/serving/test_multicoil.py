"""Multi-coil scans through the gadget: 2- and 8-coil data, channel masks, the header's coil count."""

import math

import ismrmrd
import numpy as np
import pytest
import torch

from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings
from masc_gadget.acquisition.policies import make_policy
from masc_gadget.mrd.header import parse_header
from masc_gadget.serving.gadget import GadgetSettings, process

N = 32


def _header(coils=None):
    system = (f"<acquisitionSystemInformation><receiverChannels>{coils}</receiverChannels>"
              f"</acquisitionSystemInformation>" if coils else "")
    return (f"<?xml version='1.0'?><ismrmrdHeader xmlns='http://www.ismrm.org/ISMRMRD'>{system}"
            f"<experimentalConditions><H1resonanceFrequency_Hz>127000000</H1resonanceFrequency_Hz>"
            f"</experimentalConditions><encoding><encodedSpace><matrixSize><x>{N}</x><y>{N}</y><z>1</z></matrixSize>"
            f"<fieldOfView_mm><x>300</x><y>300</y><z>3</z></fieldOfView_mm></encodedSpace><reconSpace><matrixSize>"
            f"<x>{N}</x><y>{N}</y><z>1</z></matrixSize><fieldOfView_mm><x>300</x><y>300</y><z>3</z></fieldOfView_mm>"
            f"</reconSpace><encodingLimits><slice><minimum>0</minimum><maximum>1</maximum><center>0</center></slice>"
            f"</encodingLimits><trajectory>cartesian</trajectory></encoding></ismrmrdHeader>")


def _kspace(seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:N, :N]
    obj = (((y - N / 2) ** 2 + (x - N / 2) ** 2) < (0.35 * N) ** 2) * (1 + 0.3 * rng.random((N, N)))
    return np.fft.fftshift(np.fft.fft2(np.fft.ifftshift(obj), norm="ortho")).astype(np.complex64)


def _acq(samples, slice_index, line, mask_bits=None):
    acq = ismrmrd.Acquisition.from_array(np.ascontiguousarray(samples, dtype=np.complex64))
    acq.idx.slice, acq.idx.kspace_encode_step_1 = slice_index, line
    if mask_bits:
        head = acq.getHead()
        words = [0] * 16
        for b in mask_bits:
            words[b // 64] |= 1 << (b % 64)
        head.channel_mask[:] = words
        acq.setHead(head)
    return acq


def _run(items, header, **settings):
    sent, errors = [], []
    stats = process(iter(items), parse_header(header), GadgetSettings(policy="center-out", initial=2, budget=3, device="cpu",
                                                        **settings), sent.append, on_error=errors.append)
    images = {im.slice: im.data[0, 0] for im in sent if isinstance(im, ismrmrd.Image)}
    return stats, images, errors


def _scan(k_by_slice, weights, lines=(15, 16, 17, 14, 18), mask_bits=None):
    return [_acq(w[:, None] * k[line][None] if w is not None else k[line][None], s, line, mask_bits)
            for s, k in enumerate(k_by_slice) for line in lines for w in [weights]]


@pytest.mark.parametrize("coils", [2, 8])
@pytest.mark.parametrize("combine", ["rss", "sensitivity"])
def test_uniform_coils_give_the_single_coil_image(coils, combine):
    ks = [_kspace(0), _kspace(1)]
    weights = (np.exp(1j * np.linspace(0, 2, coils)) / math.sqrt(coils)).astype(np.complex64)
    single_stats, single, errors = _run(_scan(ks, None), _header())
    assert not errors and single_stats["images"] == 2
    stats, multi, errors = _run(_scan(ks, weights), _header(coils), coil_combine=combine)
    assert not errors and stats["images"] == 2 and stats["rejected"] == 0
    for s in (0, 1):
        np.testing.assert_allclose(multi[s], single[s], rtol=1e-4, atol=1e-5 * single[s].max())


def test_channel_mask_and_the_header_are_honoured():
    ks = [_kspace(0), _kspace(1)]
    weights = np.array([0.6, 0.8], dtype=np.complex64)
    _, single, _ = _run(_scan(ks, None), _header())
    # the scan's coils are channels 3 and 5 of 8 (channel_mask), rows in that order
    stats, images, errors = _run(_scan(ks, weights, mask_bits=[3, 5]), _header(8))
    assert not errors and stats["images"] == 2
    np.testing.assert_allclose(images[0], single[0], rtol=1e-4, atol=1e-5 * single[0].max())
    # a line without one of the scan's channels is rejected, with a message that names them; the
    # slice still finishes from its other lines
    acqs = _scan(ks, weights, mask_bits=[3, 5])
    acqs[2] = _acq(0.6 * ks[0][17][None], 0, 17, mask_bits=[3])
    stats, images, errors = _run(acqs, _header(8))
    assert stats["rejected"] == 1 and "without [5]" in errors[0] and stats["images"] == 2
    # channels beyond the header's receiverChannels: each such line is rejected, and none starts the scan
    stats, images, errors = _run(_scan(ks, weights, mask_bits=[3, 5]), _header(4))
    assert stats["images"] == 0 and stats["rejected"] == len(errors) > 0
    assert all("uses channel 5, but the header has 4 receiver channel" in e for e in errors)


def test_engine_takes_one_row_per_coil_and_combines_them():
    k = _kspace(2)
    weights = (np.ones(4) / 2).astype(np.complex64)  # sum |a|^2 = 1
    results = {}
    for coils, data in ((1, k), (4, weights[:, None, None] * k[None])):
        settings = EngineSettings(n_pe=N, n_readout=N, initial=2, budget=2, seed=0, device="cpu", n_coils=coils)
        engine = AcquisitionEngine(settings, make_policy("random"))
        decisions = [d.line for line in (15, 16) for d in engine.on_line(0, line, data[line] if coils == 1
                                                                            else data[:, line])]
        with pytest.raises(ValueError, match="expected 4 channels" if coils == 4 else "expected one channel"):
            engine.on_line(0, 3, np.zeros((3, N), np.complex64))
        results[coils] = (decisions, engine.finish_slice(0).image)
    assert results[1][0] == results[4][0]  # the same random stream, the same decision
    torch.testing.assert_close(torch.from_numpy(results[4][1]), torch.from_numpy(results[1][1]), rtol=1e-4,
                               atol=1e-5 * float(results[1][1].max()))
    with pytest.raises(ValueError, match="coil_combine"):
        EngineSettings(n_pe=N, n_readout=N, initial=2, budget=2, seed=0, device="cpu", n_coils=2, coil_combine="x")


def test_server_refuses_a_scan_whose_coils_exceed_its_kspace_budget():
    import json
    import socket

    from masc_gadget.config import load_config
    from masc_gadget.mrd.frames import ID_TEXT, ConnectionClosed
    from masc_gadget.mrd.protocol import MrdStream
    from masc_gadget.serving.server import MascServer
    from tests.conftest import CONFIGS

    # one slice of 8 coils x 32 x 32 x 8 bytes = 64 KiB > the 32 KiB a scan may hold; one coil fits
    config = load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", "server.max_kspace_bytes=32768"])
    server = MascServer(config, address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        def scan(coils):
            stream = MrdStream(socket.create_connection(("127.0.0.1", port), timeout=10))
            stream.send_config_file("default")
            stream.send_header(_header(coils))
            stream.send_text(json.dumps({"initial": 2, "budget": 3}))
            weights = np.ones(coils, np.complex64) / math.sqrt(coils)
            try:
                for acq in _scan([_kspace(0), _kspace(1)], weights if coils > 1 else None):
                    stream.send_acquisition(acq)
                stream.send_close()
            except OSError:  # refused: the server may close before the client has sent everything
                pass
            texts = []
            while True:
                try:
                    msg = stream.read_message()
                except ConnectionClosed:
                    break
                if msg.id == ID_TEXT:
                    texts.append(msg.payload)
            stream.close()
            return texts

        refused = scan(8)
        assert any("server.max_kspace_bytes" in t for t in refused), refused
        assert not any("max_kspace_bytes" in t for t in scan(1))  # and it goes on serving others
    finally:
        server.shutdown()


class _LooksAtImage(make_policy("center-out").__class__):
    """Centre-out, but it reads the image (so every decision reconstructs the slice)."""

    name = "looks-at-image"
    needs_image = True

    def choose(self, state, rng):
        if not np.isfinite(state.image).all():
            raise AssertionError("the policy was shown a non-finite image")
        return super().choose(state, rng)


@pytest.mark.parametrize("order", ["linear", "reverse", "centre-last"])
def test_sensitivity_combine_rejects_no_line_of_a_late_centre_stream(order):
    """A 4-coil slice streamed in a scanner's order to an engine whose policy reads images: every
    line is stored, none is rejected, and the image is that of all lines."""
    rng = np.random.default_rng(2)
    weights = (rng.normal(size=4) + 1j * rng.normal(size=4)).astype(np.complex64)
    k = _kspace()
    lines = {"linear": list(range(N)), "reverse": list(range(N))[::-1],
             "centre-last": [l for l in range(N) if l != N // 2] + [N // 2]}[order]
    engine = AcquisitionEngine(EngineSettings(n_pe=N, n_readout=N, initial=2, budget=N - 2, seed=0, device="cpu",
                                              n_coils=4, coil_combine="sensitivity"), _LooksAtImage())
    decisions = 0
    for line in lines:
        decisions += len(engine.on_line(0, line, weights[:, None] * k[line][None]))  # never raises
    assert decisions > 0 and engine.acquired(0) == lines
    image = engine.finish_slice(0).image
    full = np.abs(np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(k), norm="ortho")))  # the object
    # uniform coil weights: the sensitivity combine returns |object| * sqrt(sum |w|^2)
    expected = full * np.sqrt((np.abs(weights) ** 2).sum())
    np.testing.assert_allclose(image, expected, rtol=1e-3, atol=1e-3 * expected.max())


def test_a_channel_mask_that_disagrees_with_the_data_is_a_warning_not_a_rejection(caplog):
    """A mask naming 1 channel on 2-row data (scanners set such masks): every line is used, the
    data's channels in row order, and the log says so once."""
    ks = [_kspace(0), _kspace(1)]
    weights = np.array([0.6, 0.8], dtype=np.complex64)
    reference = _run(_scan(ks, weights), _header(2))
    with caplog.at_level("WARNING"):
        stats, images, errors = _run(_scan(ks, weights, mask_bits=[0]), _header(2))
    assert errors == [] and stats["rejected"] == 0 and stats["images"] == 2
    for s in (0, 1):
        np.testing.assert_array_equal(images[s], reference[1][s])
    said = [r.getMessage() for r in caplog.records if "channel_mask names 1 channel(s)" in r.getMessage()]
    assert len(said) == 1 and "the data's 2 channel(s) are used" in said[0]


def test_a_matrix_the_learned_policy_cannot_play_is_refused_with_the_remedy():
    from masc_gadget.config import ConfigError
    from masc_gadget.serving.models import build_engine

    settings = GadgetSettings(policy="masc", policy_checkpoint="shipped:masc_small", device="cpu")
    with pytest.raises(ConfigError, match=r"trained for 128 x 128 images .* this scan reconstructs 32 x 32: "
                                          r"serve it with a policy that plays any matrix .*\"policy\": \"center-out\""):
        build_engine(settings, N, N)
    # through Gadgetron (eager) the refusal comes at the header, before any line
    sent = []
    with pytest.raises(ConfigError, match="acquisition.policy=center-out"):
        process(iter([]), parse_header(_header()), settings, sent.append, eager=True)
    assert sent == []
