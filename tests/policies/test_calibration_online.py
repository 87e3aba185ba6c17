"""Calibration that learns from rounds: the survival table (offline fit_table, online
OnlineCalibration) and Platt scaling find a planted calibration; an observe without labels
changes nothing; online recalibration keeps decoding lossless (greedy equals plain decoding,
sampled output follows the target's law); calibrate scores a held-out split."""
import json
import time

import numpy as np
import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.policies import Calibration, OnlineCalibration, TableCalibration, ThresholdPolicy
from dspark_rt.policies import sts
from dspark_rt.policies.online import fit_platt, fit_table
from dspark_rt.tools.calibrate import calibrate
from dspark_rt.tools.evaluate import evaluate

from tests.support import lossless_harness as H

GAMMA = 4
PLANTED = np.array([0.5, 2.0, 1.5, 3.0])  # raw logit = true logit * planted_k


def planted_rounds(n, seed=0):
    """(raw logits [n, gamma], accepted [n], verified [n] = gamma, true survival [n, gamma]):
    true conditional acceptance of draft k is sigmoid(raw logit_k / planted_k)."""
    rng = np.random.default_rng(seed)
    true = rng.normal(1.5, 2.0, size=(n, GAMMA))
    c = 1.0 / (1.0 + np.exp(-true))
    accepted = np.cumprod(rng.random((n, GAMMA)) < c, axis=1).sum(axis=1)
    return true * PLANTED, accepted, np.full(n, GAMMA), np.cumprod(c, axis=1)


def table_rounds(n, seed=0):
    """Rounds whose true survival is a known monotone map of the raw head's survival s_k:
    a_k = sigmoid(2 logit(s_k) + 2), steeper and higher than the head (greedy-like: a chain that
    survives its first drafts tends to survive all), which no per-position temperature fits."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 2.5, size=(n, GAMMA))
    s = np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=1)
    a = 1.0 / (1.0 + np.exp(-(2.0 * np.log(s / (1.0 - s)) + 2.0)))
    accepted = (rng.random(n)[:, None] < a).sum(axis=1)  # one draw: survival is a prefix
    return z, accepted, np.full(n, GAMMA), a


def feed(cal, z, acc, ver, R=16):
    for i in range(0, len(z), R):
        cal.observe(torch.tensor(z[i:i + R], dtype=torch.float32), ver[i:i + R].tolist(),
                    acc[i:i + R].tolist())
    cal.flush()


def test_online_converges_to_the_true_survival():
    z, acc, ver, _ = table_rounds(40_000, seed=1)
    cal = OnlineCalibration(Calibration.identity(GAMMA), GAMMA, half_life=1e9, record=True)
    feed(cal, z, acc, ver)
    assert cal.table is not None and cal.refits == -(-40_000 // 16 // cal.refit_every)
    zt, acct, vert, true = table_rounds(20_000, seed=2)
    a = cal.apply(torch.tensor(zt))[1].double().numpy()
    # bins 0.5 wide in the survival logit (the true map moves ~0.05 within one), plus the noise
    # of 4 * 10^4 labels per position
    err = np.abs(a - true).mean(axis=0)
    assert (err < 0.025).all(), err
    report = sts.compare(zt, acct, vert, None, survival=a)
    assert all(r["ece_after"] < 0.02 for r in report), report
    # power: the raw head and the best temperatures are far off on the same rounds
    raw = sts.compare(zt, acct, vert, [1.0] * GAMMA)
    assert max(r["ece_after"] for r in raw) > 0.1
    best = sts.fit_sts(z, acc, ver)
    held = sts.compare(zt, acct, vert, best.temperatures)
    assert max(r["ece_after"] for r in held) > 0.04, held
    # the survivals the last rounds were served with are calibrated too
    a_in, _, acc_in = (np.concatenate([r[i] for r in cal.record[-100:]]) for i in range(3))
    for k in range(GAMMA):
        assert sts.ece(a_in[:, k], acc_in >= k + 1) < 0.03


def test_online_follows_a_change_of_workload():
    """The half-life forgets: after the workload changes, the table follows the new one."""
    z, acc, ver, _ = planted_rounds(20_000, seed=7)
    cal = OnlineCalibration(None, GAMMA, half_life=64)
    feed(cal, z, acc, ver)
    z2, acc2, ver2, true2 = table_rounds(20_000, seed=8)
    feed(cal, z2, acc2, ver2)
    a = cal.apply(torch.tensor(z2[-4000:]))[1].double().numpy()
    assert np.abs(a - true2[-4000:]).mean() < 0.04


def test_offline_fits_recover_planted_calibration():
    z, acc, ver, true = planted_rounds(40_000, seed=3)
    platt = fit_platt(z, acc, ver)
    # conditional c_k = sigmoid(z_k / planted_k): t_k = planted_k, b_k = 0
    np.testing.assert_allclose(platt.temperatures, PLANTED, rtol=0.05)
    np.testing.assert_allclose(np.divide(platt.biases, platt.temperatures), 0.0, atol=0.06)
    a = platt.calibration().apply(torch.tensor(z[:5000]))[1].double().numpy()
    assert np.abs(a - true[:5000]).mean() < 0.01
    z, acc, ver, true = table_rounds(40_000, seed=3)
    table = fit_table(z, acc, ver)
    a = table.calibration().apply(torch.tensor(z[:5000]))[1].double().numpy()
    assert np.abs(a - true[:5000]).mean() < 0.025
    assert all(r["ece_after"] < 0.02 for r in table.report)


def test_files_round_trip(tmp_path):
    z, acc, ver, _ = planted_rounds(5000, seed=4)
    for res in (fit_platt(z, acc, ver), fit_table(z, acc, ver)):
        path = res.save(tmp_path / "cal.json")
        back = sts.read_temperatures(path)
        want = res.calibration().apply(torch.tensor(z[:100]))
        got = back.apply(torch.tensor(z[:100]))
        torch.testing.assert_close(got, want)
        with pytest.raises(ValueError, match="temperatures only"):
            res.save_sglang(tmp_path / "sglang.json")
    # an old STS file (temperatures only) still loads, as plain temperature scaling
    old = {"format": sts.FORMAT, "version": 1, "temperatures": [1.0, 2.0, 0.5, 1.5]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    cal = sts.read_temperatures(tmp_path / "old.json")
    assert type(cal) is Calibration and cal.biases is None
    bad = dict(old, survival_table=[[0.5, 0.1]] * 4)  # decreasing rows are refused
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="survival_table"):
        sts.read_temperatures(tmp_path / "bad.json")


def test_observe_without_labels_does_nothing():
    cal = OnlineCalibration(Calibration([0.7, 1.3, 1.0, 2.0]), GAMMA, refit_every=1,
                            min_labels=1)
    z = torch.randn(3, GAMMA)
    before = cal.apply(z)
    cal.observe(None, [], [])                     # a plain round: no confidences
    cal.observe(z, [0, 0, 0], [0, 0, 0])          # nothing verified
    cal.flush()
    assert cal.pending == [] and cal.refits == 0 and cal.table is None
    assert not cal.stats.n.any() and not cal.stats.pos.any()
    torch.testing.assert_close(cal.apply(z), before)
    cal.observe(z, [2, 0, 1], [1, 0, 1])          # labels: it learns
    assert cal.refits == 1 and cal.stats.n.sum() == 3 and cal.table is not None


def test_observe_host_cost():
    """observe runs every round on the host: tens of microseconds, refits included."""
    z, acc, ver, _ = planted_rounds(16 * 400, seed=5)
    cal = OnlineCalibration(None, GAMMA)
    rounds = [(torch.tensor(z[i:i + 16], dtype=torch.float32), ver[i:i + 16].tolist(),
               acc[i:i + 16].tolist()) for i in range(0, len(z), 16)]
    t0 = time.perf_counter()
    for r in rounds:
        cal.observe(*r)
    us = (time.perf_counter() - t0) / len(rounds) * 1e6
    print(f"observe: {us:.1f} us per round of 16 requests (refit every {cal.refit_every})")
    assert us < 500  # generous: the 2-core CI machine is shared (measured ~30-50 us)


def test_survival_is_a_prefix_product_on_any_input():
    """Policies need 0 <= a_k <= a_{k-1} <= 1 and c_hat = a_k / a_{k-1}, for any logits."""
    z, acc, ver, _ = table_rounds(5000, seed=6)
    cal = fit_table(z, acc, ver).calibration()
    assert isinstance(cal, TableCalibration)
    x = torch.cat([torch.randn(200, GAMMA) * 30, torch.full((1, GAMMA), 1e4),
                   torch.full((1, GAMMA), -1e4)])
    c_hat, a = cal.apply(x)
    assert torch.isfinite(a).all() and (a >= 0).all() and (a <= 1).all()
    assert (a[:, 1:] <= a[:, :-1] + 1e-7).all()
    torch.testing.assert_close(torch.cumprod(c_hat.double(), 1).float(), a, atol=1e-6, rtol=1e-5)


# -- lossless with online recalibration ---------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "dspark_rt" / "pretrained"
    return str(root / "target"), str(root / "dspark")


def test_greedy_with_online_calibration_equals_plain_decoding(shipped):
    target, drafter = shipped
    prompts = [[5 + i, 40 + 3 * i, 100 + i, 7] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ar = Decoder.from_pretrained(target, mode="ar").generate(prompts, params, use_tqdm=False)
    dec = Decoder.from_pretrained(target, drafter, policy=ThresholdPolicy(0.5),
                                  online_calibration=True)
    assert isinstance(dec.engine.calibration, OnlineCalibration)
    assert dec.calibration_source.endswith(" + online")
    dec.engine.calibration.refit_every, dec.engine.calibration.min_labels = 2, 8
    outs = dec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    cal = dec.engine.calibration
    assert cal.refits > 2 and cal.table is not None  # the lengths came from refitted tables
    m = [o.metrics for o in outs]
    drafted = sum(x.num_draft_tokens for x in m)
    assert 0 < drafted < sum(x.num_rounds for x in m) * 7  # threshold cut some drafts


# (case, batch size, requests). sync and async verify ~1 % of drafts on this pair once the
# confidences are calibrated (drafts rarely pay at SPS(B) = B^-1/2): no test of the lengths
LOSSLESS = [(H.Case("dspark", "threshold", "vanilla", 1.0), 200, 4000),
            (H.Case("dspark", "threshold", "gated", 1.0, top_p=0.8), 200, 4000)]


@pytest.mark.parametrize("case,batch,n", LOSSLESS, ids=[c.id for c, _, _ in LOSSLESS])
def test_sampled_output_law_with_online_calibration(tmp_path_factory, case, batch, n):
    """The harness of test_lossless_sampling.py with the calibration refitted every round from
    the rounds before. Power: the same run with the harness's threshold-lookahead variant (the
    verify decision peeks at the token being verified) gives p = 2.5e-6 at N = 4000, far below
    the pass level 1e-3 (correct code: p = 1.0)."""
    pair = H.write_pair(tmp_path_factory.mktemp("online_pair"))
    dec = Decoder.from_pretrained(pair["target"], pair[case.head], policy=H.make_policy(case),
                                  dtype="float32", online_calibration=True)
    cal = dec.engine.calibration
    cal.refit_every, cal.min_labels = 1, 16
    params = [SamplingParams(temperature=case.T, top_k=case.top_k, top_p=case.top_p,
                             seed=10_000 + i, max_tokens=5,
                             ignore_eos=True) for i in range(n)]
    outs = []  # in batches: the table changes between and within them (>= 40 refits)
    for i in range(0, n, batch):
        outs += dec.generate([H.PROMPT] * batch, params[i:i + batch], use_tqdm=False)
    tokens = np.array([o.token_ids[:H.N_TOK] for o in outs])
    p, detail = H.pvalue(tokens, H.exact_joint(pair["target"], case.T, case.top_k, case.top_p))
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    rounds = sum(o.metrics.num_rounds for o in outs)
    print(f"refits {cal.refits}, verified {drafted / (rounds * 3):.2f}, p {p:.3g}")
    assert cal.refits >= 40 and cal.table is not None
    assert 0.05 < drafted / (rounds * 3) < 0.95, "the policy must verify some drafts, cut others"
    assert p > H.P_PASS, detail


# -- calibrate / eval ---------------------------------------------------------------------------

def test_calibrate_scores_a_held_out_split(tiny_target, tiny_drafters, tmp_path):
    drafter = tiny_drafters("vanilla", GAMMA)
    lines = [json.dumps({"turns": [f"def f{i}(x):\n    return x * {i} + {i * i}"]})
             for i in range(8)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "cal.json"
    res = calibrate(tiny_target, drafter, prompts, out, max_tokens=16, progress=False,
                    method="table", holdout=0.25)
    h = res.metadata["holdout"]
    assert h["n_prompts"] == 2 and res.metadata["n_prompts"] == 6 and h["n_rounds"] > 0
    assert [r["position"] for r in h["report"]] == list(range(1, GAMMA + 1))
    assert all({"ece_before", "ece_after", "n"} <= set(r) for r in h["report"])
    back = json.loads(out.read_text())
    assert back["metadata"]["holdout"]["n_prompts"] == 2 and "survival_table" in back
    with pytest.raises(ValueError, match="not both"):
        calibrate(tiny_target, drafter, prompts, out, holdout=0.5, holdout_prompts=prompts)
    s = evaluate(tiny_target, drafter, prompts, calibration=str(out), out_dir=tmp_path / "ev",
                 max_tokens=16, warmup=2, online_calibration=True, progress=False)
    assert s["calibration"] == f"{out} + online" and s["n_prompts"] == 6
    assert s["warmup_prompts"] == 2 and s["confidence"]["pooled"]["n"] > 0
