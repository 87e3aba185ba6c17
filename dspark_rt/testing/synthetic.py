"""BENCHMARK ONLY: acceptance drawn from a given per-position distribution instead of the target.

Random-weight models (the only large ones this project can build without downloading weights)
accept next to nothing, so a throughput benchmark on them would measure rounds of length one.
With synthetic acceptance every round still runs the real draft forward, sequential head,
scheduler, verify forward and rejection sampler, whose costs are what the benchmark measures;
afterwards the accepted count is replaced by a draw from `accept_prob`, and the emitted tokens
by the accepted drafts plus the target's greedy token at the first unaccepted row. The confidence
logits the scheduler sees are set to logit(accept_prob), so calibrated survival equals the true
survival of this synthetic process.

The output is NOT the target model's. It is a Round subclass (SyntheticRound) that a benchmark
installs on a Decoder's engine with install(), which warns; nothing in the serving path knows it.
"""
import math
import warnings

import torch

from ..policies import Calibration
from ..runner.round import Round

__all__ = ["SyntheticAcceptance", "SyntheticRound", "install", "uninstall", "PRESETS"]

# Named conditional acceptance profiles (P(draft k accepted | 1 .. k-1 accepted), k = 1 .. 7).
# "tau5": falls from 0.92 to 0.76 along the block, so that tau at gamma 7 is 5.05, the DSpark
# paper's headline acceptance length for Qwen3-8B (about 5); its exact per-position table is
# not reproduced here, only its tau and a decay of the usual shape.
PRESETS = {"tau5": [0.92, 0.88, 0.85, 0.82, 0.80, 0.78, 0.76]}


class SyntheticAcceptance:
    """accept_prob[k - 1] = P(draft k accepted | drafts 1 .. k-1 accepted), k = 1 .. gamma.
    Draws come from a torch generator seeded with `seed` on the round's device (no host sync)."""

    def __init__(self, accept_prob, seed: int = 0):
        probs = [float(p) for p in accept_prob]
        if not probs or any(not 0.0 <= p <= 1.0 for p in probs):
            raise ValueError(f"accept_prob must be a non-empty list of probabilities in [0, 1], "
                             f"got {list(accept_prob)!r}")
        self.accept_prob, self.seed = probs, seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def expected_tau(self, length: int) -> float:
        """Mean tokens per round when `length` drafts are verified (the target's token included)."""
        tau, survive = 1.0, 1.0
        for p in self.accept_prob[:length]:
            survive *= p
            tau += survive
        return tau

    def _alpha(self, gamma: int, device) -> torch.Tensor:
        if len(self.accept_prob) < gamma:
            raise ValueError(f"accept_prob has {len(self.accept_prob)} entries, the drafter "
                             f"drafts {gamma}")
        return torch.tensor(self.accept_prob[:gamma], dtype=torch.float64).to(device, non_blocking=True)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def conf_logit(self, R: int, gamma: int, like: torch.Tensor) -> torch.Tensor:
        """[R, gamma] float32 logits whose sigmoid is accept_prob (clamped off 0 and 1)."""
        p = [min(max(x, 1e-12), 1 - 1e-12) for x in self.accept_prob[:gamma]]
        logit = torch.tensor([math.log(x / (1 - x)) for x in p], dtype=torch.float32)
        return logit.to(like.device, non_blocking=True).expand(R, gamma).contiguous()

    def accept(self, drafts, lengths, logits, cu_rows):
        """drafts [R, gamma] int64, lengths [R] int64 (drafts verified), target logits [N, V] with
        request r's rows cu_rows[r] .. (int32 [R + 1]). Returns num_accepted [R] int32,
        out_tokens [R, gamma + 1] int64 (x_1 .. x_a, y, then -1) and failed [R] (NaN or +inf in
        one of the request's rows), as ops.rejection_sample."""
        R, gamma = drafts.shape
        dev = drafts.device
        k = torch.arange(gamma, device=dev)
        u = torch.rand(R, gamma, generator=self._generator(dev), device=dev, dtype=torch.float64)
        ok = (u < self._alpha(gamma, dev)) & (k < lengths[:, None])
        a = ok.long().cumprod(1).sum(1)  # leading accepted positions
        y = logits[cu_rows[:-1].long() + a].argmax(-1)
        out = torch.full((R, gamma + 1), -1, dtype=torch.int64, device=dev)
        out[:, :gamma] = torch.where(k < a[:, None], drafts, -1)
        out.scatter_(1, a[:, None], y[:, None])
        bad_rows = ~(logits.amax(-1) < float("inf"))
        owner = torch.repeat_interleave(torch.arange(R, device=dev), (cu_rows[1:] - cu_rows[:-1]).long())
        bad = torch.zeros(R, dtype=torch.int64, device=dev).index_add_(0, owner, bad_rows[: owner.numel()].long())
        return a.int(), out, bad > 0


class SyntheticRound(Round):
    """A Round whose confidences and acceptance come from a SyntheticAcceptance."""

    def __init__(self, synthetic: SyntheticAcceptance):
        super().__init__()
        self.synthetic = synthetic

    def confidences(self, draft):
        R, gamma = draft.tokens.shape
        return self.synthetic.conf_logit(R, gamma, draft.tokens)

    def sample(self, runner, draft, plan, logits, rng):
        if draft is None:
            return super().sample(runner, draft, plan, logits, rng)
        lengths = plan.device[0] if plan.device is not None else runner.upload(plan.lengths, torch.int64)
        return self.synthetic.accept(draft.tokens, lengths, logits, plan.meta.cu_q)


def install(decoder, accept_prob, *, seed: int = 0) -> SyntheticAcceptance:
    """Replaces acceptance in every later round of this Decoder's engine (benchmarks only)."""
    eng = decoder.engine
    if eng.runner.gamma == 0:
        raise ValueError("synthetic acceptance needs a drafter (mode 'dflash' or 'dspark')")
    syn = SyntheticAcceptance(accept_prob, seed)
    syn._alpha(eng.runner.gamma, "cpu")  # enough positions
    warnings.warn("dspark_rt.testing.synthetic: acceptance is drawn from a given distribution; "
                  "outputs are not the target model's (benchmark mode)", stacklevel=2)
    eng.round = SyntheticRound(syn)
    eng.calibration = Calibration.identity(eng.runner.gamma)
    return syn


def uninstall(decoder, calibration: Calibration | None = None):
    """Back to real acceptance (with the given calibration, or none)."""
    eng = decoder.engine
    eng.round = Round()
    eng.calibration = calibration or Calibration.identity(max(eng.runner.gamma, 1))
