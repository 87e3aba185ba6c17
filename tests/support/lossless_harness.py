"""The harness behind tests/e2e/test_lossless_sampling.py: exact output laws of a tiny target, sampling
through the public API, the statistics, their power, and the deliberately wrong variants.

Run as a script to re-measure the power table of the test module's docstring:

    python -m tests.support.lossless_harness            # every case and mutant at N_POWER samples

Target: 8 tokens, so the exact joint law of the first five emitted tokens y1..y5 after the prompt
is computable by enumeration (8**4 sequences in one batched forward). Drafters: gamma 3, so y2..y5
come from the first one or two speculative rounds and the statistics below straddle round
boundaries (a round emits 1..4 tokens).
"""
import contextlib
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2 as chi2_dist, ncx2

from dspark_rt import Decoder, SamplingParams, ops, testing
from dspark_rt.runner.logits_process import filter_rows
from dspark_rt.ops import philox, reference
from dspark_rt.policies import AsyncScheduler, AutoPolicy, SyncScheduler, ThresholdPolicy
from dspark_rt.policies.sps import SPSProfile
from dspark_rt.runner import Runner

from tests.support.helpers import batched_full_logits
from tests.support.processor_laws import PROCS

V, PROMPT, N_TOK = 8, [1, 2, 3], 5
HEADS = ("none", "vanilla", "gated", "rnn")
# Statistics: marginals of y2..y5 and the joint law of consecutive pairs (y2,y3), (y3,y4),
# (y4,y5); a case's p-value is their Bonferroni-corrected minimum.
STATS = [(1,), (2,), (3,), (4,), (1, 2), (2, 3), (3, 4)]
P_PASS, P_FAIL = 1e-3, 1e-6
# SPS(B) = B^-1/2 up to 2**17 verify tokens: a draft pays when its survival exceeds about
# tau / 2B (~0.4-0.5 at the start), so sync and async verify some drafts and cut others.
SPS = SPSProfile([2 ** i for i in range(18)], [2 ** (-i / 2) for i in range(18)])


# --- the pair -------------------------------------------------------------------------------------

def write_pair(root) -> dict:
    """A V=8 target (peaky logits) and one gamma-3 drafter per head type; returns paths."""
    paths = {"target": str(root / "target")}
    testing.write_tiny_target(paths["target"], seed=3, vocab=V, hidden=32, layers=2, heads=2,
                              kv_heads=1, head_dim=16, logit_scale=4.0)
    paths["selector"] = str(_dflash2(root, paths["target"]))
    for head in HEADS:
        paths[head] = str(root / head)
        testing.write_tiny_drafter(paths[head], paths["target"], head=head, layers=1,
                                   block_size=3, target_layer_ids=[0], markov_rank=4,
                                   confidence=True, confidence_markov=head != "none", seed=11,
                                   share_target_layers=True)
        if head != "none":
            _sharpen(paths[head])
    return paths


def _dflash2(root, target):
    """A DFlash2 drafter (gamma 3) whose selector matters: its unary is capped, its candidates
    are the top 4 of 8 (half the vocabulary is never drafted, so the residual must cover it),
    and its codebooks give a strong order-one bias among them."""
    from tests.support import packagings as pk
    path = pk.dflash2(root / "dflash2_src", target, layers=1, block_size=4, rank=4, top_k=4,
                      seed=11, output_multiplier=1.0, softcap=6.0, target_layer_ids=[0])
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        w[name] *= 2.0
    w["candidate_selector.hidden_projection.weight"] *= 4.0
    save_file(w, f)
    return path


def _sharpen(path):
    """Makes the random head matter: a Markov bias of order one next to the base logits (so q
    from U and q from z differ), and a confidence that depends mostly on the previous token
    (so verify decisions that peek at the token being verified are biased strongly)."""
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    g = torch.Generator().manual_seed(5)
    w["markov_head.markov_w2.weight"] *= 20.0
    cw = w["confidence_head.proj.weight"]
    r = w["markov_head.markov_w1.weight"].shape[1]
    cw[:, :-r] *= 0.1
    cw[:, -r:] = torch.randn(cw.shape[0], r, generator=g, dtype=cw.dtype) * 2.0
    w["confidence_head.proj.bias"].zero_()
    save_file(w, f)


def exact_joint(target_path, T: float, top_k: int = 0, top_p: float = 1.0, proc: str = "") -> np.ndarray:
    """Exact law of (y1..y5) [V]*5 under the (filtered) target at temperature T, with the
    logits processor PROCS[proc]."""
    dec = Decoder.from_pretrained(target_path, mode="ar", dtype="float64")
    suffixes = torch.cartesian_prod(*[torch.arange(V)] * (N_TOK - 1))  # [V**4, 4]
    seqs = torch.cat([torch.tensor(PROMPT).expand(len(suffixes), -1), suffixes], 1)
    logits = batched_full_logits(dec.target, seqs)[:, len(PROMPT) - 1:]  # [S, 5, V]
    logits = PROCS[proc].mask(logits, suffixes)
    rows = filter_rows(logits.reshape(-1, V) / T, top_k, top_p, PROCS[proc].min_p)
    probs = torch.softmax(rows, -1).view(len(suffixes), N_TOK, V)
    joint = probs[:, 0].gather(1, suffixes[:, :1])[:, 0]
    for k in range(1, N_TOK - 1):
        joint = joint * probs[:, k].gather(1, suffixes[:, k:k + 1])[:, 0]
    joint = joint[:, None] * probs[:, N_TOK - 1]  # [V**4, V]: y1..y4 rows, y5 column
    return joint.view(*[V] * N_TOK).numpy()


# --- sampling through the public API --------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    mode: str           # "dflash" | "dspark"
    policy: str         # "fixed" | "threshold" | "sync" | "async" | "auto"
    head: str           # a HEADS entry, or "selector" (the DFlash2 drafter)
    T: float
    top_k: int = 0
    top_p: float = 1.0
    nan_drafts: bool = False  # the drafter reports NaN q at some positions (poison_drafts)
    proc: str = ""            # a logits processor of processor_laws.PROCS

    @property
    def id(self) -> str:
        f = (f"-k{self.top_k}" if self.top_k else "") + (f"-p{self.top_p}" if self.top_p < 1 else "")
        return f"{self.mode}-{self.policy}-{self.head}-T{self.T}{f}" + ("-nan" if self.nan_drafts else "") \
            + (f"-{self.proc}" if self.proc else "")


@dataclass
class Sample:
    tokens: np.ndarray        # [N, 5]
    rounds: int = 0
    drafted: int = 0          # drafts sent to verification
    accepted: int = 0


THRESHOLD = 0.5


def make_policy(case: Case, mutant=None):
    if mutant is not None and mutant.policy is not None:
        return mutant.policy()
    if case.policy == "auto":  # plain rounds win on these profiles: it alternates plain rounds
        # and exploring ones (a share of the batch drafts), lengths from its own round cost
        return AutoPolicy(SPS, SPS.scaled(3.0), SPS, explore_every=2, explore_share=0.5)
    return {"fixed": "fixed", "threshold": ThresholdPolicy(THRESHOLD), "sync": SyncScheduler(SPS),
            "async": AsyncScheduler(SPS)}[case.policy]


def sample(paths, case: Case, n: int, mutant=None, seed0: int = 10_000) -> Sample:
    """n requests of PROMPT with distinct seeds, N_TOK tokens each, under `mutant` (or none)."""
    dec = Decoder.from_pretrained(paths["target"], paths[case.head], mode=case.mode,
                                  policy=make_policy(case, mutant), dtype="float32")
    proc = PROCS[case.proc]

    def params(s):
        p = SamplingParams(temperature=case.T, top_k=case.top_k, top_p=case.top_p, seed=s,
                           max_tokens=N_TOK, ignore_eos=True, **proc.params)
        if proc.bad_words:  # what update_from_tokenizer makes of words (no tokenizer here)
            p._bad_words_token_ids = [list(w) for w in proc.bad_words]
        return p
    with contextlib.ExitStack() as stack:
        if case.nan_drafts:
            stack.enter_context(Mutant("", "", case, ops_patch={"markov_sample": poison_drafts}).patch())
        if mutant is not None:
            stack.enter_context(mutant.patch())
        if case.policy == "async":  # a first batch leaves budgets planned on its survivals
            dec.generate([PROMPT] * (n // 4), [params(seed0 - 1 - i) for i in range(n // 4)],
                         use_tqdm=False)
        outs = dec.generate([PROMPT] * n, [params(seed0 + i) for i in range(n)], use_tqdm=False)
    # a stop token emitted early (a wrong min_tokens) repeats to N_TOK: the law gives it 0
    s = Sample(np.array([(o.token_ids + o.token_ids[-1:] * N_TOK)[:N_TOK] for o in outs]))
    for o in outs:
        m = o.metrics
        s.rounds += m.num_rounds
        s.drafted += m.num_draft_tokens
        s.accepted += m.num_accepted_tokens
    return s


# --- statistics and power -------------------------------------------------------------------------

def _cells(tokens, joint, axes):
    """Observed counts and expected probabilities of the marginal of y[axes]."""
    other = tuple(a for a in range(N_TOK) if a not in axes)
    expected = joint.sum(other).ravel()
    idx = np.zeros(len(tokens), dtype=np.int64)
    for a in axes:
        idx = idx * V + tokens[:, a]
    return np.bincount(idx, minlength=V ** len(axes)).astype(float), expected


def chi2_stat(counts, expected_p):
    """(statistic, degrees of freedom), cells with expected count < 5 merged into one."""
    n = counts.sum()
    exp = expected_p / expected_p.sum() * n
    small = exp < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    stat = float((((counts - exp) ** 2)[keep] / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def pvalue(tokens, joint) -> tuple[float, dict]:
    """Bonferroni-corrected minimum p over STATS, and each statistic's (p, X2, df)."""
    detail = {}
    for axes in STATS:
        stat, df = chi2_stat(*_cells(tokens, joint, axes))
        detail["y" + "".join(str(a + 1) for a in axes)] = (float(chi2_dist.sf(stat, df)), stat, df)
    p = min(1.0, len(STATS) * min(v[0] for v in detail.values()))
    return p, detail


def power(detail: dict, n_pilot: int, n: int, alpha: float = P_FAIL) -> float:
    """Power at n samples to reject at level alpha (after the Bonferroni factor), from the
    noncentrality lambda = X2 - df each statistic showed at n_pilot samples, scaled by n / n_pilot
    (lambda grows linearly with the sample size). Takes the best statistic (a lower bound on the
    power of their minimum)."""
    best = 0.0
    for _, stat, df in detail.values():
        lam = max(0.0, stat - df) * n / n_pilot
        crit = chi2_dist.isf(alpha / len(STATS), df)
        best = max(best, float(ncx2.sf(crit, df, lam)) if lam > 0 else alpha / len(STATS))
    return best


# --- deliberately wrong variants ------------------------------------------------------------------

_real_rejection, _real_markov, _real_filter = ops.rejection_sample, ops.markov_sample, Runner.filter


@dataclass
class Mutant:
    name: str
    why: str
    case: Case
    ops_patch: dict = field(default_factory=dict)   # attribute of dspark_rt.ops -> replacement
    runner_patch: dict = field(default_factory=dict)
    policy: object = None                           # a VerifyPolicy factory replacing the case's

    @contextlib.contextmanager
    def patch(self):
        saved = [(ops, k, getattr(ops, k)) for k in self.ops_patch]
        saved += [(Runner, k, getattr(Runner, k)) for k in self.runner_patch]
        try:
            for k, v in self.ops_patch.items():
                setattr(ops, k, v)
            for k, v in self.runner_patch.items():
                setattr(Runner, k, v)
            yield
        finally:
            for obj, k, v in saved:
                setattr(obj, k, v)


def _rows_T(temperature, cu_rows):
    """Per-row temperature [N, 1] in float64 from per-request temperatures and cu_rows."""
    counts = (cu_rows[1:] - cu_rows[:-1]).long()
    return torch.repeat_interleave(temperature.double(), counts)[:, None]


def poison_drafts(logits, hidden, anchor, head, **kw):
    """A drafter that overflows: after sampling, q is NaN at draft position 2 of every request
    (z and lse) and at position 1 of requests with an even anchor (lse only). Whatever it
    reports, the output law must stay the target's."""
    tokens, logprob, lse, conf = _real_markov(logits, hidden, anchor, head, **kw)
    z = kw.get("out") if kw.get("out") is not None else logits  # where the op wrote z
    z[:, 1] = float("nan")
    lse[:, 1] = float("nan")
    lse[anchor % 2 == 0, 0] = float("nan")
    return tokens, logprob, lse, conf


def nan_draft_through(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw):
    """The rule before non-finite drafts were rejections: a NaN draft row is tested like any
    other (u q < P is false) and its residual max(0, P - q) is NaN everywhere, whose argmax is
    token 0."""
    acc, out, failed = _real_rejection(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw)
    if draft_tokens is None:
        return acc, out, failed
    ell = (cu_rows[1:] - cu_rows[:-1] - 1).long()
    rej = torch.nonzero(acc.long() < ell)[:, 0]
    a = acc.long()[rej]
    bad = reference.nonfinite_q(draft_logits[rej, a], draft_lse[rej, a])
    out[rej[bad], a[bad]] = 0
    return acc, out, failed


def emit_from_p(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw):
    """After a rejection, emits y ~ P instead of the residual max(0, P - q)."""
    acc, out, failed = _real_rejection(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw)
    if draft_tokens is None:
        return acc, out, failed
    ell = (cu_rows[1:] - cu_rows[:-1] - 1).long()
    rej = torch.nonzero(acc.long() < ell)[:, 0]
    if len(rej):
        a = acc.long()[rej]
        rows = target_logits[cu_rows.long()[rej] + a].double() / kw["temperature"][rej, None].double()
        g = philox.gumbel(kw["seed"][rej, None], kw["stream"][rej, None], kw["round_"][rej, None],
                          philox.PURPOSE_EMIT, (a + 1)[:, None], torch.arange(rows.shape[1])[None])
        out[rej, a] = reference._first_argmax(rows + g)
    return acc, out, failed


def q_from_u(logits, hidden, anchor, head, **kw):
    """Acceptance sees q = softmax(U / T) of the base logits, not of z = U + bias (the head's
    correction is lost between the sampler and the acceptance)."""
    U = logits.clone()
    tokens, logprob, lse, conf = _real_markov(logits, hidden, anchor, head, **kw)
    T = kw["temperature"].double()
    logits.copy_(U)
    lse = torch.logsumexp(U.double() / torch.where(T == 0, 1.0, T)[:, None, None], -1).to(lse.dtype)
    return tokens, logprob, lse, conf


def selector_q_unmasked(logits, hidden, anchor, head, **kw):
    """DFlash2: the acceptance's q is the softmax of U + bias over the whole vocabulary, not
    over the step's top-k candidates the draft was sampled from."""
    U = logits.clone()
    tokens, logprob, lse, conf = _real_markov(logits, hidden, anchor, head, **kw)
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], 1)
    u = (hidden @ kw["gate_w"].T) * kw["w1"][prev]
    logits.copy_(U + u @ kw["w2"].T)
    T = kw["temperature"].double()
    lse = torch.logsumexp(logits.double() / torch.where(T == 0, 1.0, T)[:, None, None], -1).to(lse.dtype)
    return tokens, logprob, lse, conf


def q_untempered(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw):
    """Acceptance uses q = softmax(z) while the draft was sampled from softmax(z / T)."""
    if draft_tokens is not None:
        T = kw["temperature"].to(draft_logits.dtype)[:, None, None]
        draft_lse = torch.logsumexp(draft_logits, -1)
        draft_logits = draft_logits * T
    return _real_rejection(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw)


def p_untempered(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw):
    """Verify rounds use P = softmax(target logits) without the temperature (plain steps keep it)."""
    if draft_tokens is not None:
        target_logits = (target_logits.double() * _rows_T(kw["temperature"], cu_rows)).to(target_logits.dtype)
    return _real_rejection(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw)


def bonus_from_previous_row(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw):
    """When every verified draft is accepted, the bonus token is drawn from row l - 1 (P of the
    last draft's own position) instead of row l."""
    acc, out, failed = _real_rejection(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, **kw)
    if draft_tokens is None:
        return acc, out, failed
    ell = (cu_rows[1:] - cu_rows[:-1] - 1).long()
    full = torch.nonzero((acc.long() == ell) & (ell > 0))[:, 0]
    if len(full):
        a = ell[full]
        rows = target_logits[cu_rows.long()[full] + a - 1].double() / kw["temperature"][full, None].double()
        g = philox.gumbel(kw["seed"][full, None], kw["stream"][full, None], kw["round_"][full, None],
                          philox.PURPOSE_EMIT, (a + 1)[:, None], torch.arange(rows.shape[1])[None])
        out[full, a] = reference._first_argmax(rows + g)
    return acc, out, failed


def filter_plain_steps_only(self, batch, logits, cu_rows, ids=None):
    """Top-k / top-p applied to plain steps (one row per request) but not to verify rounds."""
    if cu_rows[-1] == len(cu_rows) - 1:
        return _real_filter(self, batch, logits, cu_rows, ids)
    return logits


def bad_words_committed_only(self, batch, logits, cu_rows, ids=None):
    """Bad words matched against the committed tokens only: the drafts before a verify row are
    not part of its context."""
    if ids is not None:
        starts = torch.tensor(cu_rows[:-1], dtype=torch.int64)
        ids = torch.full_like(ids, -2).index_copy(0, starts, ids[starts])  # anchors only
    return _real_filter(self, batch, logits, cu_rows, ids)


class ThresholdLookahead(ThresholdPolicy):
    """Threshold off by one position: draft x_k is verified when c_hat_{k+1} (which the head
    computed from x_k) clears the threshold."""
    name = "threshold-lookahead"

    def lengths(self, decision, c_hat, survival, cap):
        ahead = torch.cat([c_hat[:, 1:], c_hat[:, -1:]], 1)
        keep = (ahead > self.threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return torch.minimum(keep, cap)


MUTANTS = [
    Mutant("emit-from-P", "residual replaced by P after a rejection",
           Case("dspark", "fixed", "vanilla", 1.0), ops_patch={"rejection_sample": emit_from_p}),
    Mutant("q-from-U", "acceptance sees the base logits U, not the head-corrected z",
           Case("dspark", "fixed", "gated", 1.0), ops_patch={"markov_sample": q_from_u}),
    Mutant("selector-q-unmasked", "DFlash2: q over the whole vocabulary, not the candidates",
           Case("dspark", "fixed", "selector", 1.0),
           ops_patch={"markov_sample": selector_q_unmasked}),
    Mutant("q-untempered", "acceptance's q drops the temperature",
           Case("dspark", "fixed", "vanilla", 0.6), ops_patch={"rejection_sample": q_untempered}),
    Mutant("P-untempered", "verify rounds' P drops the temperature",
           Case("dflash", "fixed", "none", 1.5), ops_patch={"rejection_sample": p_untempered}),
    Mutant("bonus-row-off-by-one", "bonus token drawn from the last draft's row",
           Case("dspark", "fixed", "rnn", 1.0),
           ops_patch={"rejection_sample": bonus_from_previous_row}),
    Mutant("filter-one-side", "top-k/top-p applied to plain steps, not to verify rounds",
           Case("dspark", "fixed", "vanilla", 1.0, top_k=3),
           runner_patch={"filter": filter_plain_steps_only}),
    Mutant("bad-words-committed-only", "bad words matched against committed tokens, not the "
           "drafts before the row", Case("dspark", "fixed", "vanilla", 1.0, proc="bad_words"),
           runner_patch={"filter": bad_words_committed_only}),
    Mutant("processor-one-side", "allowed_token_ids applied to plain steps, not verify rounds",
           Case("dspark", "fixed", "gated", 1.0, proc="allowed"),
           runner_patch={"filter": filter_plain_steps_only}),
    Mutant("nan-draft-through", "a NaN draft row is tested and emits its NaN residual's argmax",
           Case("dspark", "fixed", "vanilla", 1.0, nan_drafts=True),
           ops_patch={"rejection_sample": nan_draft_through}),
    Mutant("threshold-lookahead", "threshold reads the next position's confidence",
           Case("dspark", "threshold", "vanilla", 1.0),
           policy=lambda: ThresholdLookahead(THRESHOLD)),
]


def main():
    import argparse
    import tempfile
    import time
    from pathlib import Path
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--only", default="")
    a = p.parse_args()
    paths = write_pair(Path(tempfile.mkdtemp()))
    joints = {}
    for m in MUTANTS:
        if a.only and a.only not in m.name:
            continue
        c = m.case
        key = (c.T, c.top_k, c.top_p, c.proc)
        if key not in joints:
            joints[key] = exact_joint(paths["target"], *key)
        t0 = time.time()
        s = sample(paths, c, a.n, m)
        pv, detail = pvalue(s.tokens, joints[key])
        s0 = sample(paths, c, a.n)
        p0, _ = pvalue(s0.tokens, joints[key])
        print(f"{m.name:24s} p={pv:.2e} (correct p={p0:.2e}) power@n: "
              + ", ".join(f"{n}:{power(detail, a.n, n):.3f}" for n in (3000, 10000, 20000, 40000))
              + f"  acc {s.accepted}/{s.drafted}  {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
