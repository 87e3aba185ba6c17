"""Kernel test cases as data: one small dataclass per op, lists of cases, and generators that
turn a case into fresh random inputs on any device and float dtype.

Tests (every backend against ops.reference) and benchmarks (bench/) draw from the same
generators, so benchmarked inputs are also checked inputs. Randomness is fresh every run:
SEED comes from DSPARK_TEST_SEED or the system and every input is a pure function of
(SEED, case, key), so `DSPARK_TEST_SEED=<seed>` reproduces a failure; assertion messages
carry it (see `where`).

Generators draw every value on the CPU in float64 and then move/cast it, so a CUDA test with the
same SEED sees the same values (rounded to its dtype); benchmarks pass gen_device="cuda" to draw
shapes too large for the host directly on the GPU.
"""
import math
import os
import random
import zlib
from dataclasses import dataclass

import torch

from ..ops import philox

SEED = int(os.environ.get("DSPARK_TEST_SEED") or random.SystemRandom().randrange(2**31))


def where(case, key=0) -> str:
    """What to print next to a failure: the case and how to reproduce its inputs."""
    return f"{case} key={key} (reproduce with DSPARK_TEST_SEED={SEED})"


def _seed_of(case, key):
    return (SEED * 1_000_003 + zlib.crc32(repr((case, key)).encode())) % 2**63


def generator(case, key=0) -> torch.Generator:
    """A CPU generator that is a pure function of (SEED, case, key)."""
    return torch.Generator().manual_seed(_seed_of(case, key))


class _Rand:
    """Random draws for one case. On the CPU (the default, used by every test) values are
    float64 and identical for any target device; gen_device="cuda" draws float32 directly on
    the GPU (benchmark shapes too large to build on the host; different values, same laws)."""

    def __init__(self, case, key, gen_device="cpu"):
        self.dev = torch.device(gen_device)
        self.g = torch.Generator(device=self.dev).manual_seed(_seed_of(case, key))
        self.fdt = torch.float64 if self.dev.type == "cpu" else torch.float32

    def randn(self, *shape, scale=1.0):
        return torch.randn(*shape, generator=self.g, device=self.dev, dtype=self.fdt) * scale

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.g, device=self.dev, dtype=self.fdt)

    def randint(self, lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=self.g, device=self.dev, dtype=torch.int64)

    def randperm(self, n):
        return torch.randperm(n, generator=self.g, device=self.dev)

    def multinomial(self, p, n=1):
        return torch.multinomial(p.to(self.fdt), n, replacement=True, generator=self.g)


def strided(t):
    """A non-contiguous view holding the same values as t (None stays None)."""
    if t is None or t.dim() == 0:
        return t
    return torch.stack([t, t], dim=-1)[..., 0]


def _to(t, device, dtype):
    return None if t is None else t.to(device=device, dtype=dtype)


def _seeds(rd, R):
    """[R] int64 holding arbitrary uint64 bit patterns (negative values included)."""
    return (rd.randint(-2**31, 2**31, (R,)) << 32) | rd.randint(0, 2**32, (R,))


def _temperatures(rd, R, mode):
    """[R] float32: 0 (greedy), U(0.3, 2) (sampled), both interleaved (mixed) or U(0.01, 0.03)
    (cold: z / T in the thousands, where float exponents lose digits)."""
    t = 0.3 + 1.7 * rd.rand(R)
    if mode == "cold":
        t = 0.01 + 0.02 * rd.rand(R)
    if mode == "greedy":
        t.zero_()
    elif mode == "mixed":
        t[::2] = 0.0
    return t.to(torch.float32)


def _coupled(R, mode):
    """[R] per-request coupled flags (None for "none"): "mixed" flags requests r % 3 != 0 as
    uint8 (with mixed temperatures: coupled greedy, coupled sampled and plain sampled rows),
    "all" flags every request as bool."""
    if mode == "none":
        return None
    if mode == "all":
        return torch.ones(R, dtype=torch.bool)
    return (torch.arange(R) % 3 != 0).to(torch.uint8)


def _keys(rd, R):
    """Random (seed, stream, round): streams are mostly 0 (a request with its own seed)."""
    stream = torch.where(rd.rand(R) < 0.7, 0, rd.randint(1, 2**20, (R,)))
    return _seeds(rd, R), stream, rd.randint(0, 10_000, (R,))


# --------------------------------------------------------------------------------------------
# markov_sample

@dataclass(frozen=True)
class MarkovCase:
    R: int
    gamma: int
    V: int
    head: str = "vanilla"      # none | vanilla | gated | rnn | selector
    top_k: int = 0             # selector: candidates per step
    ties: bool = False         # logits on a grid of halves: many exact ties (the top-k rule)
    rank: int = 16
    d: int = 32
    conf: str = "none"         # none | plain (w . h_k) | markov (w . [h_k; W1[x_{k-1}]])
    temps: str = "mixed"       # greedy | sampled | mixed
    noncontig: bool = False    # hidden and weights as strided views (the door copies them)
    coupled: str = "none"      # none | mixed | all: Gumbel-coupled requests (_coupled)


MARKOV_CASES = [
    MarkovCase(1, 1, 1, "none", temps="sampled"),
    MarkovCase(1, 1, 3, "vanilla", rank=4, d=8),
    MarkovCase(1, 7, 37, "gated", conf="markov", temps="sampled"),
    MarkovCase(2, 4, 1000, "rnn", conf="plain"),
    MarkovCase(3, 5, 5003, "vanilla", rank=64, d=48, conf="markov"),
    MarkovCase(4, 7, 1000, "gated", rank=24, d=40, conf="plain", temps="greedy"),
    MarkovCase(3, 3, 1024, "rnn", rank=8, d=16, conf="markov", noncontig=True),
    MarkovCase(5, 2, 2049, "none", conf="plain", temps="sampled", noncontig=True),
    MarkovCase(2, 6, 37, "none", rank=8, conf="markov"),  # Markov feature without a head
    MarkovCase(6, 3, 517, "vanilla", rank=33, d=17, temps="mixed"),
    MarkovCase(6, 4, 1000, "vanilla", rank=16, temps="mixed", coupled="mixed"),
    MarkovCase(3, 5, 517, "gated", conf="markov", temps="sampled", coupled="all"),
    MarkovCase(4, 3, 1030, "rnn", rank=8, d=16, temps="sampled", coupled="mixed"),
    MarkovCase(5, 2, 2049, "none", temps="sampled", coupled="mixed", noncontig=True),
    MarkovCase(1, 1, 1, "selector", rank=4, d=8, top_k=1, temps="sampled"),
    MarkovCase(3, 6, 37, "selector", rank=8, d=16, top_k=37, temps="mixed"),  # top_k = V
    MarkovCase(4, 7, 1000, "selector", rank=16, d=32, top_k=16, temps="mixed", ties=True),
    MarkovCase(2, 5, 5003, "selector", rank=64, d=48, top_k=6, conf="markov", temps="sampled",
               coupled="mixed", noncontig=True),
    MarkovCase(5, 3, 517, "selector", rank=8, d=24, top_k=40, conf="plain", temps="greedy",
               ties=True),
]


def markov_inputs(case: MarkovCase, device="cpu", dtype=torch.float32, key=0,
                  gen_device="cpu") -> dict:
    """Keyword arguments of ops.markov_sample (logits included) for `case`."""
    rd = _Rand(case, key, gen_device)
    R, G, V, r, d = case.R, case.gamma, case.V, case.rank, case.d
    uses_w = case.head != "none" or case.conf == "markov"
    w1 = rd.randn(V, r) if uses_w else None
    w2 = rd.randn(V, r, scale=1.5 / math.sqrt(r)) if uses_w else None
    gated, rnn, conf = case.head == "gated", case.head == "rnn", case.conf != "none"
    selector = case.head == "selector"
    conf_dim = d + r if case.conf == "markov" else d
    f = lambda t: strided(_to(t, device, dtype)) if case.noncontig else _to(t, device, dtype)
    seed, stream, round_ = _keys(rd, R)
    coupled = _coupled(R, case.coupled)
    extra = {} if coupled is None else {"coupled": coupled.to(device)}
    if selector:
        extra["top_k"] = case.top_k
    logits = rd.randn(R, G, V, scale=2.0)
    if case.ties:
        logits = (logits * 2).round() / 2
    return dict(
        **extra,
        logits=_to(logits, device, dtype),  # written in place: contiguous
        hidden=f(rd.randn(R, G, d)),
        anchor=rd.randint(0, V, (R,)).to(device),
        head=case.head,
        w1=f(w1), w2=f(w2),
        gate_w=f(rd.randn(r, d + r, scale=1 / math.sqrt(d + r))) if gated else
        f(rd.randn(r, d, scale=1 / math.sqrt(d))) if selector else None,
        gate_b=f(rd.randn(r)) if gated else None,
        joint_w=f(rd.randn(3 * r, 2 * r + d, scale=1 / math.sqrt(2 * r + d))) if rnn else None,
        joint_b=f(rd.randn(3 * r)) if rnn else None,
        conf_w=f(rd.randn(conf_dim, scale=1 / math.sqrt(conf_dim))) if conf else None,
        conf_b=f(rd.randn(1)) if conf else None,
        temperature=_temperatures(rd, R, case.temps).to(device),
        seed=seed.to(device), stream=stream.to(device), round_=round_.to(device),
    )


# --------------------------------------------------------------------------------------------
# rejection_sample

@dataclass(frozen=True)
class RejectionCase:
    R: int
    gamma: int
    V: int
    ells: str = "random"     # full (l = gamma) | random (0..gamma) | zero (l = 0)
    temps: str = "mixed"
    drafts: str = "likely"   # likely: q close to P and x ~ q (long acceptances) | random |
                             # shifted: target ~ -100, z = target + 100 exactly (the draft's max
                             # far above the target's), the drafted token is the target's least
                             # likely with q(x) = 1e-4 (rejected), so the residual max(0, P - q)
                             # is 1e-4 P everywhere: the float pre-filter's hard case at T = 0.01
    noncontig: bool = False
    coupled: str = "none"    # none | mixed | all (_coupled); likely coupled drafts are the
                             # target's coupled tokens until a random miss


REJECTION_CASES = [
    RejectionCase(1, 1, 1, "full", "sampled"),
    RejectionCase(1, 1, 3, "full", "greedy"),
    RejectionCase(3, 0, 37, "zero", "mixed"),  # gamma = 0: plain autoregressive sampling
    RejectionCase(4, 7, 37, "random", "mixed", "random"),
    RejectionCase(6, 7, 1000, "full", "mixed"),
    RejectionCase(5, 4, 5003, "random", "sampled"),
    RejectionCase(8, 3, 517, "random", "greedy", noncontig=True),
    RejectionCase(7, 5, 129, "random", "mixed", noncontig=True),
    RejectionCase(4, 16, 64, "full", "sampled", "random"),
    RejectionCase(6, 5, 1000, "random", "mixed", coupled="mixed"),
    RejectionCase(5, 4, 517, "full", "sampled", coupled="all"),
    RejectionCase(3, 0, 37, "zero", "sampled", coupled="mixed"),
    RejectionCase(7, 7, 129, "random", "mixed", "random", noncontig=True, coupled="mixed"),
    RejectionCase(6, 2, 1000, "full", "cold", "shifted"),
    RejectionCase(4, 3, 5003, "random", "cold", "shifted"),
]


def rejection_inputs(case: RejectionCase, device="cpu", dtype=torch.float32, key=0,
                     gen_device="cpu") -> dict:
    """Keyword arguments of ops.rejection_sample for `case`. draft_lse is logsumexp(z / T)
    formed in float64 (float64 iff dtype is float64, else float32), T = 1 for greedy rows."""
    rd = _Rand(case, key, gen_device)
    R, G, V = case.R, case.gamma, case.V
    if case.ells == "full":
        ells = torch.full((R,), G, dtype=torch.int64)
    elif case.ells == "zero":
        ells = torch.zeros(R, dtype=torch.int64)
    else:
        ells = rd.randint(0, G + 1, (R,)).cpu()
    cu = torch.zeros(R + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ells + 1, 0)
    N = int(cu[-1])
    target = rd.randn(N, V, scale=2.0)
    temperature = _temperatures(rd, R, case.temps)
    tsafe = torch.where(temperature == 0, 1.0, temperature.double()).to(rd.fdt)
    # Draft row k of request r predicts what target row k of r judges.
    draft = rd.randn(R, G, V, scale=2.0)
    tokens = rd.randint(0, V, (R, G))
    if case.drafts == "likely":
        for r in range(R):
            n = int(ells[r])
            if n == 0:
                continue
            rows = target[int(cu[r]):int(cu[r]) + n]
            draft[r, :n] = rows + 0.3 * rd.randn(n, V)
            if temperature[r] == 0:  # the target's choice, until a random miss
                miss = (rd.rand(n) < 0.2).long()
                tokens[r, :n] = (rows.argmax(-1) + miss) % V
            else:
                q = torch.softmax(draft[r, :n] / tsafe[r], -1)
                tokens[r, :n] = rd.multinomial(q)[:, 0]
    elif case.drafts == "shifted":
        for r in range(R):
            n, lo = int(ells[r]), int(cu[r])
            # log P spread of std 3 at any T; float32 values, so that + 100 is exact in float32
            target[lo:lo + n + 1] = (target[lo:lo + n + 1] * (1.5 * tsafe[r]) - 100.0).float()
            draft[r, :n] = target[lo:lo + n] + 100.0
            for k in range(n):
                x = int(target[lo + k].argmin())
                tokens[r, k] = x
                draft[r, k, x] = tsafe[r] * (torch.logsumexp(draft[r, k] / tsafe[r], 0) + math.log(1e-4))
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    draft_c = draft.to(device=device, dtype=dtype)
    draft_lse = torch.logsumexp(draft_c.double() / tsafe.to(device).double()[:, None, None], -1)
    seed, stream, round_ = _keys(rd, R)
    coupled = _coupled(R, case.coupled)
    extra = {} if coupled is None else {"coupled": coupled.to(device)}
    if coupled is not None and case.drafts == "likely":
        for r in range(R):
            if not coupled[r] or temperature[r] == 0:
                continue
            for k in range(int(ells[r])):  # y_k = argmax(row / T + g_{n0+k}), until a miss
                n, purpose, pos = philox.site(round_[r], True, 0, k + 1)
                g = philox.gumbel(seed[r], stream[r], n, purpose, pos, torch.arange(V))
                y = int((target[int(cu[r]) + k] / tsafe[r] + g.to(rd.fdt)).argmax())
                tokens[r, k] = (y + int(rd.rand(1) < 0.2)) % V
    view = strided if case.noncontig else (lambda t: t)
    return dict(
        **extra,
        target_logits=view(target.to(device=device, dtype=dtype)),
        cu_rows=cu.to(device),
        draft_tokens=tokens.to(device),
        draft_logits=view(draft_c) if G else None,
        draft_lse=draft_lse.to(lse_dtype) if G else None,
        temperature=temperature.to(device),
        seed=seed.to(device), stream=stream.to(device), round_=round_.to(device),
    )


# --------------------------------------------------------------------------------------------
# prefix_topk

@dataclass(frozen=True)
class PrefixTopkCase:
    R: int
    gamma: int
    mode: str = "cumprod"  # cumprod (non-increasing in j) | random | ties (few values) | nan


PREFIX_TOPK_CASES = [
    PrefixTopkCase(1, 1), PrefixTopkCase(1, 7), PrefixTopkCase(32, 7),
    PrefixTopkCase(256, 16), PrefixTopkCase(13, 5, "random"), PrefixTopkCase(9, 7, "ties"),
    PrefixTopkCase(17, 3, "nan"), PrefixTopkCase(64, 16, "ties"),
]


def prefix_topk_inputs(case: PrefixTopkCase, device="cpu", key=0, gen_device="cpu"):
    """(survival [R, gamma] float32, list of K to try: 0, 1, a few inside, R * gamma and more)."""
    rd = _Rand(case, key, gen_device)
    R, G = case.R, case.gamma
    if case.mode == "ties":
        a = rd.randint(0, 4, (R, G)).to(rd.fdt) / 4  # many exact ties
        a = a.sort(dim=1, descending=True).values
    else:
        a = rd.rand(R, G)
        if case.mode != "random":
            a = a.cumprod(dim=1)
        if case.mode == "nan":
            a[rd.rand(R, G) < 0.2] = math.nan
    n = R * G
    inner = rd.randint(0, n + 1, (4,)).tolist()
    return a.to(device=device, dtype=torch.float32), sorted({0, 1, n // 2, n, n + 3, *inner})


# --------------------------------------------------------------------------------------------
# verify_attention

@dataclass(frozen=True)
class AttentionCase:
    n_q: tuple               # chain length per request (0 = empty chain)
    ctx: tuple               # keys before the chain: kv_len = ctx + n_q
    h_q: int = 4
    h_kv: int = 2
    head_dim: int = 32
    page_size: int = 16
    causal: bool = True
    window: int = 0          # > 0: a sliding layer's window
    extra_pages: int = 3     # NaN-filled pages no request owns (stale slots are NaN too)
    noncontig: bool = False  # q as a strided view (the door copies it)

    @property
    def R(self):
        return len(self.n_q)


ATTENTION_CASES = [
    AttentionCase((1,), (0,), 1, 1, 8, 4),
    AttentionCase((0,), (5,)),  # a lone empty chain
    AttentionCase((3, 0, 8), (14, 20, 24), 6, 2, 40, 16),  # kv_len 17 (one past a page), 32
    AttentionCase((8, 8), (16, 56), 7, 1, 16, 8, causal=False),
    AttentionCase((5, 1, 2, 8), (0, 31, 31, 100), 4, 4, 64, 32),  # kv_len 32 and 33
    AttentionCase((8, 4), (7, 63), 8, 2, 128, 16, noncontig=True),
    AttentionCase((2, 0, 7), (60, 3, 1), 6, 2, 24, 8, causal=False),
    AttentionCase((16,), (300,), 6, 3, 64, 64),
    # sliding windows: binding for some rows only, narrower than the chain, a whole tile skipped
    AttentionCase((8, 1, 5), (40, 2, 9), 4, 2, 32, 8, window=12),
    AttentionCase((8, 8), (16, 200), 4, 1, 16, 16, causal=False, window=5),
    AttentionCase((16, 3), (300, 70), 6, 3, 64, 64, window=64),
    AttentionCase((7,), (500,), 2, 2, 8, 4, causal=False, window=1),
]


def attention_inputs(case: AttentionCase, device="cpu", dtype=torch.float32, key=0,
                     gen_device="cpu") -> dict:
    """Keyword arguments of ops.verify_attention for `case`: a permuted block table over a
    cache with NaN-poisoned pages nobody owns and NaN slots past every kv_len."""
    rd = _Rand(case, key, gen_device)
    n_q, hd, ps, h_kv = case.n_q, case.head_dim, case.page_size, case.h_kv
    kv_lens = [c + n for c, n in zip(case.ctx, n_q)]
    need = [(L + ps - 1) // ps for L in kv_lens]
    num_pages = sum(need) + case.extra_pages
    max_pages = max(need, default=0) + 1
    perm = rd.randperm(num_pages).cpu()  # pages handed out in random order
    # Built directly in the target dtype on the target device (benchmark caches are large).
    k_cache = torch.full((num_pages, ps, h_kv, hd), math.nan, dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, math.nan)
    tables = torch.full((case.R, max_pages), -1, dtype=torch.int32)  # unused entries: invalid
    at = 0
    for r, L in enumerate(kv_lens):
        pages = perm[at:at + need[r]]
        at += need[r]
        tables[r, :need[r]] = pages.to(torch.int32)
        k = rd.randn(need[r] * ps, h_kv, hd)
        v = rd.randn(need[r] * ps, h_kv, hd)
        k[L:] = math.nan  # slots past kv_len hold stale data
        v[L:] = math.nan
        k_cache[pages.to(device)] = _to(k.view(need[r], ps, h_kv, hd), device, dtype)
        v_cache[pages.to(device)] = _to(v.view(need[r], ps, h_kv, hd), device, dtype)
    cu_q = torch.zeros(case.R + 1, dtype=torch.int32)
    cu_q[1:] = torch.cumsum(torch.tensor(n_q, dtype=torch.int32), 0)
    q = rd.randn(int(cu_q[-1]), case.h_q, hd)
    scale = 1.25 * hd ** -0.5  # not the default, and not a float32 number
    return dict(
        q=(strided if case.noncontig else (lambda t: t))(q.to(device=device, dtype=dtype)),
        cu_q=cu_q.to(device),
        k_cache=k_cache, v_cache=v_cache,
        block_tables=tables.to(device), kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        causal=case.causal, scale=scale, **({"window": case.window} if case.window else {}),
    )

