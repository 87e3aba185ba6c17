"""Grammars for the lossless harness (tests/support/lossless_harness.py): a tiny deterministic
automaton over its 8-token vocabulary, playing a compiled grammar's matcher, the exact law
P'(. | prefix) = P * mask(prefix) / Z of the first five tokens under it, and the wrong variants
of the grammar walk that must fail.

Grammars (the state starts at the first generated token):
  regex   ([1-3][4-7])*: a token of 1..3, then one of 4..7, and again
  choice  one of three 5-token strings, a trie: "1 4 2 5 3", "1 6 0 7 2", "2 4 4 4 4"
"""
import contextlib
from unittest import mock

import numpy as np
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.structured import Constraints, StructuredOutputsParams
from dspark_rt.structured.walk import words_of

from tests.support import lossless_harness as H

CHOICES = [(1, 4, 2, 5, 3), (1, 6, 0, 7, 2), (2, 4, 4, 4, 4)]
GRAMMARS = {"regex": StructuredOutputsParams(regex="([1-3][4-7])*"),
            "choice": StructuredOutputsParams(choice=[" ".join(map(str, c)) for c in CHOICES])}


def allowed(form: str, prefix: tuple) -> set:
    """Tokens the grammar allows after the generated prefix."""
    if form == "regex":
        return {1, 2, 3} if len(prefix) % 2 == 0 else {4, 5, 6, 7}
    return {c[len(prefix)] for c in CHOICES if c[:len(prefix)] == prefix and len(c) > len(prefix)}


class ToyMatcher:
    """The automaton as a matcher (dspark_rt.structured.walk): state = the accepted tokens."""

    def __init__(self, form: str, V: int):
        self.form, self.V, self.prefix = form, V, ()

    @property
    def terminated(self) -> bool:
        return not allowed(self.form, self.prefix)

    complete = terminated  # the toy grammars end where nothing more is allowed

    def fill(self, row):
        row[:] = 0
        for t in allowed(self.form, self.prefix):
            row[t // 32] |= np.int32(1 << (t % 32))

    def accept(self, t: int) -> bool:
        if t not in allowed(self.form, self.prefix):
            return False
        self.prefix += (t,)
        return True

    def rollback(self, n: int):
        self.prefix = self.prefix[:len(self.prefix) - n]


def compiler(spec, V):
    return ToyMatcher(spec.form, V)


def masked_joint(target_path, T: float, form: str, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Exact law of (y1..y5) under P' = P * mask / Z at every position (top-k / top-p, if any,
    filter P', the grammar's distribution: the mask comes first, as in vLLM)."""
    dec = Decoder.from_pretrained(target_path, mode="ar", dtype="float64")
    V, N = H.V, H.N_TOK
    suffixes = torch.cartesian_prod(*[torch.arange(V)] * (N - 1))
    seqs = torch.cat([torch.tensor(H.PROMPT).expand(len(suffixes), -1), suffixes], 1)
    logits = H.batched_full_logits(dec.target, seqs)[:, len(H.PROMPT) - 1:] / T  # [S, 5, V]
    for i, s in enumerate(suffixes.tolist()):
        for k in range(N):
            ok = torch.zeros(V, dtype=torch.bool)
            ok[list(allowed(form, tuple(s[:k])))] = True
            logits[i, k] = logits[i, k].masked_fill(~ok, -float("inf"))
    probs = torch.softmax(H.filter_rows(logits.reshape(-1, V), top_k, top_p), -1).view(logits.shape)
    joint = probs[:, 0].gather(1, suffixes[:, :1])[:, 0]
    for k in range(1, N - 1):
        joint = joint * probs[:, k].gather(1, suffixes[:, k:k + 1])[:, 0]
    return (joint[:, None] * probs[:, N - 1]).view(*[V] * N).nan_to_num(0.0).numpy()


def sample(paths, case, form: str, n: int, mutant=None, seed0: int = 20_000):
    """n seeded requests of PROMPT under the grammar, through Decoder.generate."""
    dec = Decoder.from_pretrained(paths["target"], paths[case.head], mode=case.mode,
                                  policy=H.make_policy(case), dtype="float32")
    dec.engine.state.constraints = Constraints(compiler)
    params = lambda s: SamplingParams(temperature=case.T, top_k=case.top_k, top_p=case.top_p, seed=s,
                                      max_tokens=H.N_TOK, ignore_eos=True,
                                      structured_outputs=GRAMMARS[form])
    with mutant() if mutant is not None else contextlib.nullcontext():
        outs = dec.generate([H.PROMPT] * n, [params(seed0 + i) for i in range(n)], use_tqdm=False)
    s = H.Sample(np.array([o.token_ids[:H.N_TOK] for o in outs]))
    for o in outs:
        s.rounds += o.metrics.num_rounds
        s.drafted += o.metrics.num_draft_tokens
        s.accepted += o.metrics.num_accepted_tokens
    return s


# --- wrong variants of the walk ---------------------------------------------------------------

def _stale(self, ms, drafts, lengths, V, device):
    """Row k masked with the committed state: the matcher is not advanced through the drafts."""
    rows = np.full((sum(n + 1 for n in lengths), words_of(V)), -1, dtype=np.int32)
    at = 0
    for m, n in zip(ms, lengths):
        for k in range(n + 1):
            if m is not None:
                m.fill(rows[at + k])
        at += n + 1
    return torch.from_numpy(rows).to(device)


def stale_state():
    return mock.patch.object(Constraints, "verify_masks", _stale)


def no_rollback():
    return mock.patch.object(ToyMatcher, "rollback", lambda self, n: None)


def q_only():
    """The target rows go unmasked (only what the drafter sees would be constrained)."""
    real = Constraints.verify_masks
    return mock.patch.object(Constraints, "verify_masks",
                             lambda self, *a: torch.full_like(real(self, *a), -1))


def _residual_unmasked(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, *,
                       token_bitmask=None, **kw):
    """The acceptance test sees P', but the token after a rejection comes from max(0, P - q)
    with P unmasked."""
    acc, out, failed = _real_rejection(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse,
                                       token_bitmask=token_bitmask, **kw)
    g = torch.Generator().manual_seed(int(kw["seed"][0]) + int(kw["round_"][0]))
    for r in range(len(acc)):
        a, lo, ell, T = int(acc[r]), int(cu_rows[r]), int(cu_rows[r + 1] - cu_rows[r]) - 1, float(kw["temperature"][r])
        if a < ell and T > 0:
            P = torch.softmax(target_logits[lo + a].double() / T, -1)
            q = torch.exp(draft_logits[r, a].double() / T - float(draft_lse[r, a]))
            out[r, a] = torch.multinomial((P - q).clamp(min=0), 1, generator=g)[0]
    return acc, out, failed


_real_rejection = H.ops.rejection_sample


def residual_unmasked():
    return mock.patch.object(H.ops, "rejection_sample", _residual_unmasked)


MUTANTS = {"stale-state": stale_state, "no-rollback": no_rollback, "target-unmasked": q_only,
           "residual-unmasked": residual_unmasked}
