"""Calibration files (policies/sts.py) are refused at load, naming the file and the field, when a
number in them is unusable; NaN confidences (an overflowing drafter) are harmless: the request
drafts nothing that round."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark_rt
from dspark_rt import Decoder, SamplingParams
from dspark_rt.policies import Calibration, sts
from dspark_rt.policies.table import TableCalibration

PRETRAINED = Path(dspark_rt.__file__).parent / "pretrained"
GOOD = {"format": sts.FORMAT, "version": 1, "temperatures": [1.0, 2.0],
        "survival_table": [[0.1, 0.5, 0.9], [0.05, 0.3, 0.8]], "metadata": {"logit_range": [-4, 4]}}


def _write(tmp_path, d, text=None) -> Path:
    p = tmp_path / "cal.json"
    p.write_text(text if text is not None else json.dumps(d))
    return p


@pytest.mark.parametrize("change,field", [
    ({"metadata": {"logit_range": [math.nan, math.nan]}}, "logit_range"),
    ({"metadata": {"logit_range": [3, 3]}}, "logit_range"),
    ({"metadata": {"logit_range": [4, -4]}}, "logit_range"),
    ({"metadata": {"logit_range": [-math.inf, 4]}}, "logit_range"),
    ({"metadata": {"logit_range": ["a", 4]}}, "logit_range"),
    ({"metadata": {"logit_range": [1, 2, 3]}}, "logit_range"),
    ({"metadata": {"logit_range": 5}}, "logit_range"),
    ({"metadata": [1]}, "metadata"),
    ({"temperatures": [1.0, math.nan]}, "temperatures"),
    ({"temperatures": [1.0, math.inf]}, "temperatures"),
    ({"temperatures": [1.0, 0.0]}, "temperatures"),
    ({"temperatures": [1.0, "x"]}, "temperatures"),
    ({"temperatures": "1,2"}, "temperatures"),
    ({"temperatures": []}, "temperatures"),
    ({"temperatures": None}, "temperatures"),
    ({"temperatures": [1.0, 10 ** 400]}, "temperatures"),
    ({"survival_table": [[0.1, 0.5], [0.1]]}, "survival_table"),
    ({"survival_table": [["a", 0.5, 0.9], [0.1, 0.2, 0.3]]}, "survival_table"),
    ({"survival_table": [[0.1, math.nan, 0.9], [0.05, 0.3, 0.8]]}, "survival_table"),
    ({"biases": [0.0, math.inf]}, "biases"),
    ({"report": 3}, "report"),
])
def test_bad_calibration_file_is_refused_naming_file_and_field(tmp_path, change, field):
    path = _write(tmp_path, {**GOOD, **change})
    for read in (sts.STSResult.load, sts.read_temperatures):
        with pytest.raises(ValueError) as e:
            read(path)
        assert str(path) in str(e.value) and f"'{field}'" in str(e.value), str(e.value)


def test_unreadable_calibration_file_names_the_file(tmp_path):
    path = _write(tmp_path, None, text="{not json")
    for read in (sts.STSResult.load, sts.read_temperatures):
        with pytest.raises(ValueError) as e:
            read(path)
        assert str(path) in str(e.value)


def test_good_file_loads(tmp_path):
    cal = sts.read_temperatures(_write(tmp_path, GOOD))
    assert isinstance(cal, TableCalibration) and (cal.lo, cal.hi) == (-4.0, 4.0)


@pytest.mark.parametrize("cal", [Calibration([1.0, 2.0, 0.5]),
                                 Calibration([1.0, 2.0, 0.5], [0.1, -0.2, 0.0]),
                                 TableCalibration([1.0] * 3, None, [[0.1, 0.5, 0.9]] * 3, -4.0, 4.0)],
                         ids=["sts", "platt", "table"])
def test_nan_confidence_drafts_nothing_for_that_request(cal):
    z = torch.tensor([[2.0, 1.0, 0.5], [math.nan, 1.0, 0.5], [2.0, math.nan, 3.0],
                      [math.inf, -math.inf, 0.0]])
    c_hat, a = cal.apply(z)
    assert torch.isfinite(c_hat).all() and torch.isfinite(a).all()
    assert (a[1:3] == 0).all() and (c_hat[1:3] == 0).all()
    want_c, want_a = cal.apply(z[[0, 3]])
    assert torch.equal(c_hat[[0, 3]], want_c) and torch.equal(a[[0, 3]], want_a)
    assert (a[0] > 0).all()


@pytest.mark.skipif(not (PRETRAINED / "dspark").is_dir(), reason="no shipped pair")
def test_nan_confidence_head_keeps_generating(tmp_path):
    """The shipped drafter with a NaN confidence head and its calibration table: every generate
    used to raise on the table lookup; now the survivals are 0 and greedy output stays exact.
    (Sync may still verify a zero-survival draft where the measured SPS(B + 1) > SPS(B).)"""
    drafter = tmp_path / "dspark"
    shutil.copytree(PRETRAINED / "dspark", drafter)
    w = load_file(drafter / "model.safetensors")
    w["confidence_head.proj.weight"] = torch.full_like(w["confidence_head.proj.weight"], math.nan)
    save_file(w, drafter / "model.safetensors")
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outs = Decoder.from_pretrained(PRETRAINED / "target", drafter, mode="dspark",
                                   policy="sync").generate(["def f(x):"] * 2, params, use_tqdm=False)
    plain = Decoder.from_pretrained(PRETRAINED / "target", mode="ar").generate(
        ["def f(x):"] * 2, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" and o.metrics.num_rounds > 0 for o in outs)
