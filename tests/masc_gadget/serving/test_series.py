"""What a slice comes back as: the MAR series and the zero-filled series, and the OOD fallback."""

import ismrmrd
import numpy as np
import pytest

from masc_gadget.mrd.header import parse_header
from masc_gadget.serving.gadget import process
from masc_gadget.serving.host import Host
from masc_gadget.serving.models import ModelCache
from masc_gadget.serving.settings import GadgetSettings
from training.export import export_checkpoint

from tests.masc_gadget.serving.hostile import header_xml, line

N_PE, N_RO = 16, 8


def _scan():
    """Two fully sampled slices, each ending on ACQ_LAST_IN_SLICE."""
    acqs = []
    for s in (0, 1):
        for pe in range(N_PE):
            acq = line(s, pe, seed=3, n_ro=N_RO)
            if pe == N_PE - 1:
                acq.set_flag(ismrmrd.ACQ_LAST_IN_SLICE)
            acqs.append(acq)
    return acqs


def _images(mar_path, **settings):
    sent = []
    base = GadgetSettings(policy="center-out", initial=2, budget=3, device="cpu", mar_checkpoint=str(mar_path),
                          **settings)
    process(iter(_scan()), parse_header(header_xml(N_PE, N_RO, slices=2)), base, sent.append, host=Host(cache=ModelCache()))
    return [x for x in sent if isinstance(x, ismrmrd.Image)]


def _meta(image):
    return ismrmrd.Meta.deserialize(image.attribute_string)


def test_each_slice_comes_back_as_its_mar_series_and_its_zero_filled_series(perturbed_mar):
    images = _images(perturbed_mar)
    assert [(im.slice, im.image_series_index) for im in images] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    mar, zf = images[0], images[1]
    assert _meta(mar)["ImageComments"] == "MASC MAR-corrected" and _meta(zf)["ImageComments"] == "MASC zero-filled"
    assert not np.allclose(mar.data, zf.data)  # the network is not the identity
    assert "MASC.ood_score" not in _meta(mar)  # an uncalibrated network: no score, always used
    assert [im.image_series_index for im in _images(perturbed_mar, return_zero_filled=False)] == [1, 1]


@pytest.mark.parametrize("fallback", ["auto", "off", "1e9"])
def test_a_slice_whose_ood_score_passes_the_calibrated_threshold_is_served_zero_filled(tmp_path, perturbed_mar,
                                                                                       fallback):
    path = tmp_path / "calibrated.pt"
    export_checkpoint(perturbed_mar, path, ood={"score": "residual", "threshold": 1e-6})  # flags every slice
    images = _images(path, mar_fallback=fallback)
    mar, zf = images[0], images[1]
    score = float(_meta(mar)["MASC.ood_score"])
    assert score > 1e-6
    if fallback == "auto":
        np.testing.assert_array_equal(mar.data, zf.data)
        assert _meta(mar)["MASC.mar"].startswith("none (OOD score") and "residual" in _meta(mar)["MASC.mar"]
    else:  # off: scored, never replaced; a threshold above every score: the same
        assert not np.allclose(mar.data, zf.data)
        assert _meta(mar)["MASC.mar"] == "calibrated.pt"


def test_the_fallback_setting_takes_a_number_from_json_and_text_from_xml():
    from masc_gadget.serving.settings import settings_from_json, settings_from_xml

    base = GadgetSettings()
    assert base.mar_fallback == "auto" and base.return_zero_filled is True
    assert settings_from_json('{"mar_fallback": 0.5}', base).mar_fallback == "0.5"
    xml = '<configuration><property name="mar_fallback" value="off"/></configuration>'
    assert settings_from_xml(xml, base).mar_fallback == "off"


def test_a_bad_fallback_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="mar_fallback must be auto, off or a threshold > 0, got 'never'"):
        GadgetSettings(mar_fallback="never")
