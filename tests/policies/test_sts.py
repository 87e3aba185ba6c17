"""Sequential Temperature Scaling: planted miscalibration is found and removed; files round trip."""
import json
import math

import numpy as np
import pytest
import torch

from dspark_rt.policies import sts
from dspark_rt.policies import Calibration

PLANTED = np.array([0.5, 2.0, 1.5, 3.0])
GRID = np.geomspace(0.05, 20.0, 61)  # ~10.5 % per step


def planted_rounds(n=60000, planted=PLANTED, seed=0):
    """Logged rounds whose raw logits are the true per-position logits times `planted`, so
    sigmoid(logit_k / planted_k) is the true conditional survival and STS should find planted."""
    rng = np.random.default_rng(seed)
    gamma = len(planted)
    true_logit = rng.normal(2.0, 2.0, size=(n, gamma))
    p = 1.0 / (1.0 + np.exp(-true_logit))
    survived = np.cumprod(rng.random((n, gamma)) < p, axis=1).sum(axis=1)
    verified = rng.integers(0, gamma + 1, size=n)
    accepted = np.minimum(survived, verified)  # only the verified prefix can be accepted
    return true_logit * planted, accepted, verified


def test_recovers_planted_temperatures_and_lowers_ece():
    z, acc, ver = planted_rounds()
    res = sts.fit_sts(z, acc, ver, grid=GRID)
    steps = np.log(np.asarray(res.temperatures) / PLANTED) / np.log(GRID[1] / GRID[0])
    # ECE is a noisy, flat objective near its minimum: two grid steps, plus half a step because
    # the planted values are not grid points.
    assert np.abs(steps).max() <= 2.5, (res.temperatures, steps)
    for row in res.report:
        assert row["ece_after"] < row["ece_before"], row
        assert row["ece_after"] < 0.02, row
        assert row["brier_after"] <= row["brier_before"] + 1e-9, row
    # position 1's ranking is one logit: a temperature cannot change its AUC
    assert res.report[0]["auc_after"] == pytest.approx(res.report[0]["auc_before"], abs=1e-12)
    cal = res.calibration()
    assert isinstance(cal, Calibration) and cal.temperatures == res.temperatures
    c_hat, surv = cal.apply(torch.tensor(z[:5], dtype=torch.float32))
    np.testing.assert_allclose(surv.numpy(), sts.survivals(z[:5], res.temperatures), rtol=1e-5)


def test_masks_unverified_positions():
    """Labels past the verified length are unknown; garbage there must not move the fit."""
    z, acc, ver = planted_rounds(n=20000, seed=1)
    base = sts.fit_sts(z, acc, ver, grid=GRID)
    z2 = z.copy()
    k = np.arange(1, z.shape[1] + 1)
    z2[ver[:, None] < k[None, :]] = 50.0
    assert sts.fit_sts(z2, acc, ver, grid=GRID).temperatures == base.temperatures
    with pytest.raises(ValueError):
        sts.fit_sts(z, ver + 1, ver)  # accepted > verified


def test_metrics_small_cases():
    p = np.array([0.1, 0.4, 0.35, 0.8])
    y = np.array([0, 0, 1, 1])
    assert sts.auc(p, y) == pytest.approx(0.75)
    assert sts.auc(np.array([0.5, 0.5, 0.5]), np.array([0, 1, 1])) == pytest.approx(0.5)  # ties
    assert math.isnan(sts.auc(p, np.ones(4)))
    assert sts.brier(p, y) == pytest.approx(np.mean((p - y) ** 2))
    # two bins: [0, .5) holds 0.1, 0.4, 0.35 (mean .2833 vs 1/3), [.5, 1] holds 0.8 (vs 1)
    assert sts.ece(p, y, n_bins=2) == pytest.approx((3 * abs(0.85 / 3 - 1 / 3) + abs(0.8 - 1)) / 4)
    assert sts.ece(np.array([1.0, 0.0]), np.array([1, 0]), n_bins=15) == 0.0


def test_json_round_trip(tmp_path):
    z, acc, ver = planted_rounds(n=5000, seed=2)
    res = sts.fit_sts(z, acc, ver, grid=GRID, metadata={"drafter": "tiny"})
    path = res.save(tmp_path / "sts.json")
    json.loads(path.read_text())  # strict JSON (NaN written as null)
    back = sts.STSResult.load(path)
    assert back.temperatures == res.temperatures
    assert back.metadata["drafter"] == "tiny" and back.metadata["gamma"] == 4
    assert [r["position"] for r in back.report] == [1, 2, 3, 4]
    assert sts.read_temperatures(path).temperatures == res.temperatures
    with pytest.raises(ValueError):
        sts.STSResult.load(_write(tmp_path / "other.json", {"temperatures": [1.0]}))


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path


# SGLang's DSpark STS calibration JSON (sglang .../dspark_components/dspark_sts.py,
# DSparkStsCalibration): what its fitter writes, and the minimal file its loader accepts.
SGLANG_FITTED = {"temperatures": [0.9, 1.1, 1.3], "dataset": "/data/sts/confidence.*.pt",
                 "num_samples": 4096, "ece_before": [0.08, 0.11, 0.15],
                 "ece_after": [0.01, 0.02, 0.02]}


@pytest.mark.parametrize("obj", [
    SGLANG_FITTED,
    {"temperatures": [0.9, 1.1, 1.3]},
    {"temperatures": [0.9, 1.1, 1.3], "fitted_by": "someone"},  # unknown fields are ignored
    {"temperatures": [0.9, 1.1, 1.3], "num_samples": 0, "dataset": ""},
])
def test_reads_sglang_sts_json(tmp_path, obj):
    path = _write(tmp_path / "sts.json", obj)
    assert sts.read_temperatures(path).temperatures == [0.9, 1.1, 1.3]
    d = sts.read_sglang_sts(path)
    assert set(d) == set(sts.SGLANG_STS_FIELDS)
    for name in ("dataset", "num_samples", "ece_before", "ece_after"):
        assert d[name] == obj.get(name, {"dataset": "", "num_samples": 0}.get(name, []))


def test_sglang_temperatures_apply_per_draft_position(tmp_path):
    """temperatures[k] scales the logit of draft k (k = 0 is the first draft after the anchor)."""
    cal = sts.read_temperatures(_write(tmp_path / "sts.json", {"temperatures": [0.5, 2.0]}))
    z = torch.tensor([[1.0, 1.0], [-2.0, 4.0]], dtype=torch.float64)
    c_hat, surv = cal.apply(z)
    want = torch.sigmoid(z / torch.tensor([0.5, 2.0], dtype=torch.float64))
    torch.testing.assert_close(c_hat, want.float())
    torch.testing.assert_close(surv, torch.cumprod(want, dim=1).float())


@pytest.mark.parametrize("obj,field", [
    ({"dataset": "x"}, "temperatures"),                                   # required field missing
    ({"temperatures": []}, "temperatures"),
    ({"temperatures": [1.0, -2.0]}, "temperatures"),
    ({"temperatures": [1.0, 0.0]}, "temperatures"),
    ({"temperatures": [1.0, "2"]}, "temperatures"),
    ({"temperatures": [1.0, True]}, "temperatures"),
    ({"temperatures": 1.5}, "temperatures"),
    ({"temperatures": {"0": 1.0, "1": 1.1}}, "temperatures"),             # keyed by position
    ({"temperatures": [1.0], "num_samples": "12"}, "num_samples"),
    ({"temperatures": [1.0], "num_samples": 1.5}, "num_samples"),
    ({"temperatures": [1.0], "dataset": 3}, "dataset"),
    ({"temperatures": [1.0], "ece_before": [0.1, None]}, "ece_before"),
    ({"temperatures": [1.0], "ece_after": 0.1}, "ece_after"),
    ({"calibration": {"temperatures": [1.0]}}, "temperatures"),           # the old guesses
    ({"position_temperatures": [1.0]}, "temperatures"),
    ({"1": 0.9, "2": 1.1}, "temperatures"),
])
def test_rejects_malformed_sglang_sts(tmp_path, obj, field):
    path = _write(tmp_path / "bad.json", obj)
    with pytest.raises(ValueError, match=field) as e:
        sts.read_temperatures(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("text", ["[0.9, 1.1]", "0.9 1.1\n", ""])
def test_unsupported_files_name_the_supported_formats(tmp_path, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="supported") as e:
        sts.read_temperatures(path)
    assert str(path) in str(e.value) and "SGLang" in str(e.value) and sts.FORMAT in str(e.value)


def test_sglang_sts_round_trip(tmp_path):
    z, acc, ver = planted_rounds(n=5000, seed=4)
    res = sts.fit_sts(z, acc, ver, grid=GRID)
    path = res.save_sglang(tmp_path / "sts.json", dataset="planted")
    d = json.loads(path.read_text())
    assert set(d) == set(sts.SGLANG_STS_FIELDS)
    back = sts.read_sglang_sts(path)
    assert back["temperatures"] == res.temperatures
    assert back == {"temperatures": res.temperatures, "dataset": "planted", "num_samples": 5000,
                    "ece_before": [r["ece_before"] for r in res.report],
                    "ece_after": [r["ece_after"] for r in res.report]}
    assert sts.read_temperatures(path).temperatures == res.temperatures
    # defaults are left out, as SGLang's encoder does; an ECE list with a NaN too (no null there)
    bare = sts.write_sglang_sts(tmp_path / "bare.json", [1.0, 2.0],
                                ece_before=[0.1, float("nan")], ece_after=[0.1, 0.2])
    assert json.loads(bare.read_text()) == {"temperatures": [1.0, 2.0], "ece_after": [0.1, 0.2]}
    for bad in ([], [1.0, 0.0], [float("inf")]):
        with pytest.raises(ValueError):
            sts.write_sglang_sts(tmp_path / "x.json", bad)


def test_reliability_diagram_writes_png(tmp_path):
    z, acc, ver = planted_rounds(n=3000, seed=3)
    res = sts.fit_sts(z, acc, ver, grid=GRID)
    out = sts.reliability_diagram(z, acc, ver, res.temperatures, tmp_path / "rel.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
