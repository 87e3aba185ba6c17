"""Benchmark-only synthetic acceptance: the accepted count follows the given per-position
distribution (a chi-square that a wrong counting rule fails), the emitted tokens are the accepted
drafts plus the target's greedy token, and nothing of it is reachable from the serving API."""
import inspect

import pytest
import torch
from scipy.stats import chisquare

from dspark_rt import Decoder, SamplingParams
from dspark_rt.runner.round import Round
from dspark_rt.testing import synthetic
from dspark_rt.testing.synthetic import SyntheticAcceptance, SyntheticRound

ALPHA = [0.9, 0.7, 0.5, 0.4]  # the tiny DeepSpec drafter of block 4 drafts gamma = 4


def test_accept_emits_drafts_then_the_targets_greedy_token():
    syn = SyntheticAcceptance([1.0, 1.0, 0.0, 1.0])
    drafts = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    lengths = torch.tensor([4, 1, 0])
    cu = torch.tensor([0, 5, 7, 8], dtype=torch.int32)
    logits = torch.randn(8, 11, dtype=torch.float64)
    logits[6, 3] = float("nan")  # request 1's last row
    acc, out, failed = syn.accept(drafts, lengths, logits, cu)
    assert acc.tolist() == [2, 1, 0]  # position 3 always rejects; lengths cap the others
    assert failed.tolist() == [False, True, False]
    best = logits.argmax(-1)  # a NaN row: torch takes the NaN
    assert out.tolist() == [[5, 6, int(best[2]), -1, -1], [1, int(best[6]), -1, -1, -1],
                            [int(best[7]), -1, -1, -1, -1]]


def _accepted_counts(decoder, n_requests=8, max_tokens=160):
    """Accepted counts of every round that verified all gamma drafts (from the round log)."""
    decoder.round_log = []
    decoder.generate([[1 + i, 2 + i] for i in range(n_requests)],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
    g = decoder.runner.gamma
    return [a for e in decoder.round_log for a, n in zip(e["accepted"], e["lengths"]) if n == g]


def _chi2_p(counts, alpha):
    expected, survive = [], 1.0
    for p in alpha + [0.0]:
        expected.append(survive * (1 - p))
        survive *= p
    hist = [counts.count(j) for j in range(len(alpha) + 1)]
    return chisquare(hist, [e * len(counts) for e in expected]).pvalue


class _CountsAllSuccesses(SyntheticAcceptance):
    """Deliberately wrong: counts every successful position, not the leading run."""

    def accept(self, drafts, lengths, logits, cu_rows):
        R, gamma = drafts.shape
        k = torch.arange(gamma)
        u = torch.rand(R, gamma, generator=self._generator(drafts.device), dtype=torch.float64)
        a = ((u < self._alpha(gamma, "cpu")) & (k < lengths[:, None])).long().sum(1)
        y = logits[cu_rows[:-1].long() + a].argmax(-1)
        out = torch.full((R, gamma + 1), -1, dtype=torch.int64)
        out[:, :gamma] = torch.where(k < a[:, None], drafts, -1)
        out.scatter_(1, a[:, None], y[:, None])
        return a.int(), out, torch.zeros(R, dtype=torch.bool)


def test_accepted_counts_follow_the_given_distribution(tiny_target, tiny_drafters):
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4), mode="dspark")
    with pytest.warns(UserWarning, match="not the target model's"):
        syn = synthetic.install(dec, ALPHA, seed=3)
    counts = _accepted_counts(dec)
    assert len(counts) > 400
    assert _chi2_p(counts, ALPHA) > 1e-3
    tau = 1 + sum(counts) / len(counts)
    assert abs(tau - syn.expected_tau(4)) < 0.1, (tau, syn.expected_tau(4))

    dec.engine.round = SyntheticRound(_CountsAllSuccesses(ALPHA, seed=3))
    assert _chi2_p(_accepted_counts(dec), ALPHA) < 1e-6


def test_scheduler_sees_the_synthetic_survival(tiny_target, tiny_drafters):
    # calibrated confidences equal ALPHA, so a 0.6 threshold verifies exactly two drafts
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("gated", 4), mode="dspark",
                                  policy="threshold", threshold=0.6)
    with pytest.warns(UserWarning):
        synthetic.install(dec, ALPHA)
    dec.round_log = []
    dec.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                 use_tqdm=False)
    lengths = [n for e in dec.round_log for n in e["lengths"]]
    assert lengths and set(lengths[:-2]) == {2}  # the last rounds are capped by max_tokens
    synthetic.uninstall(dec)
    assert type(dec.engine.round) is Round


def test_not_reachable_from_the_serving_api(tiny_target, tiny_drafters):
    for fn in (Decoder.__init__, Decoder.from_pretrained, Decoder.generate, SamplingParams):
        assert not any("synthetic" in p for p in inspect.signature(fn).parameters), fn
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4))
    assert type(dec.engine.round) is Round


def test_bad_arguments(tiny_target, tiny_drafters):
    for bad in ([], [0.5, 1.5], [-0.1]):
        with pytest.raises(ValueError, match="accept_prob"):
            SyntheticAcceptance(bad)
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4))
    with pytest.raises(ValueError, match="accept_prob has 2 entries, the drafter drafts 4"):
        synthetic.install(dec, [0.5, 0.5])
    with pytest.raises(ValueError, match="needs a drafter"):
        synthetic.install(Decoder.from_pretrained(tiny_target), ALPHA)
