"""Every op of dspark_rt._C at small shapes, for compute-sanitizer, WITHOUT torch.

    compute-sanitizer --tool=memcheck --error-exitcode=3 python bench/sanitize_ops.py --device cuda
    python bench/sanitize_ops.py --device cpu   # the same calls on the C++ kernels: checks this driver
    ... bench/sanitize_ops.py --device cuda --cases tickets   # only the atomic-ticket paths, first

The ticket cases run first in every mode: verify_attention's split-KV merge fused into the
attention kernel and rejection_sample's residual merge, where blocks meet through an atomic
ticket (racecheck's and memcheck's first business).

Why no torch: a sanitized process pays for every GPU module it loads, and torch's CUDA libraries
hold thousands of kernels, so one that imports torch spends minutes under memcheck before its
first op. Here inputs are made in numpy and copied into cupy buffers with cupy's memory pool off
(one cudaMalloc of the exact size per buffer, so one element past a buffer is out of bounds for
memcheck); no cupy kernel is compiled or launched; _C is loaded from its file, bypassing
dspark_rt/__init__ (which imports torch). The params mirror dspark_rt/ops, the door that checks
arguments (tests/repo/test_gpu_lease.py holds the codes below to it and runs this on the CPU).
Attention caches are NaN-poisoned past every kv_len and on pages nobody owns, as in
dspark_rt/testing/op_cases.py. Every output is checked (ranges, finiteness, the appended rows);
"sanitize-ok" is printed after the last op, and a failed check exits 1.
"""
import argparse
import importlib.machinery
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

DTYPE_CODE = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}  # ops.door.DTYPE_CODE
HEADS = ("none", "vanilla", "gated", "rnn", "selector")                 # ops.HEADS
ROOT = Path(__file__).resolve().parents[1]


def load_c():
    """dspark_rt._C from its file, for this interpreter's ABI, without importing the package."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = ROOT / "dspark_rt" / f"_C{suffix}"
        if path.exists():
            spec = importlib.util.spec_from_file_location("_C", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    sys.exit(f"sanitize_ops: no dspark_rt/_C{importlib.machinery.EXTENSION_SUFFIXES[0]}: build first")


def bf16(a):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), r)


def as_float(a, dtype):
    return bf16(a) if dtype == "bfloat16" else np.asarray(a, dtype=np.float32)


def to_f32(a, dtype):
    return (a.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else a


class Buffers:
    """numpy arrays in, pointers out: a device copy each (cuda) or the array itself (cpu);
    get(ptr) reads one back."""

    def __init__(self, cuda: bool):
        self.cuda, self.keep = cuda, {}
        if cuda:
            import cupy
            cupy.cuda.set_allocator(None)  # exact cudaMalloc sizes: no pool slack hides an overrun
            self.cp = cupy

    def __call__(self, a) -> int:
        a = np.ascontiguousarray(a)
        d = self.cp.asarray(a) if self.cuda else a
        ptr = d.data.ptr if self.cuda else a.ctypes.data
        self.keep[ptr] = d
        return ptr

    def get(self, ptr):
        d = self.keep[ptr]
        return self.cp.asnumpy(d) if self.cuda else d.copy()

    def sync(self):
        if self.cuda:
            self.cp.cuda.runtime.deviceSynchronize()


def check(ok, what):
    if not ok:
        sys.exit(f"sanitize_ops: FAILED check: {what}")


def markov(C, buf, be, rng, R, G, V, rank, d, head, fdt, wdt, temps="sampled", coupled=False, u16=False):
    """u16: the served 16-bit model: U in the weight dtype, z written (float32) out of place."""
    p = C.MarkovSampleParams()
    p.R, p.gamma, p.V, p.rank, p.d, p.head, p.top_k = R, G, V, rank, d, HEADS.index(head), 0
    p.confidence, p.confidence_markov = True, True
    p.dtype, p.weight_dtype, p.out_dtype = DTYPE_CODE[fdt], DTYPE_CODE[wdt], DTYPE_CODE["float32"]
    U = 2 * rng.standard_normal((R, G, V))
    if u16:
        p.u, p.u_dtype = buf(as_float(U, wdt)), DTYPE_CODE[wdt]
        p.logits = buf(np.zeros((R, G, V), np.float32))
    else:
        p.logits = buf(as_float(U, fdt))
    w = lambda *shape: buf(as_float(0.3 * rng.standard_normal(shape), wdt))
    p.hidden, p.w1, p.w2 = w(R, G, d), w(V, rank), w(V, rank)
    if head == "gated":
        p.gate_w, p.gate_b = w(rank, d + rank), w(rank)
    p.conf_w, p.conf_b = w(d + rank), w(1)
    p.anchor = buf(rng.integers(0, V, R, dtype=np.int64))
    T = {"sampled": rng.uniform(0.3, 2.0, R), "greedy": np.zeros(R),
         "mixed": np.where(np.arange(R) % 2, rng.uniform(0.3, 2.0, R), 0.0)}[temps]
    p.temperature = buf(T.astype(np.float32))
    p.seed, p.stream, p.round = (buf(rng.integers(0, 2**40, R, dtype=np.int64)) for _ in range(3))
    p.coupled = buf((np.arange(R) % 2).astype(np.uint8)) if coupled else 0
    p.tokens = buf(np.full((R, G), -1, np.int64))
    p.logprob, p.lse, p.conf_logit = (buf(np.zeros((R, G), np.float32)) for _ in range(3))
    C.markov_sample(p, be, 0)
    buf.sync()
    tok, lse = buf.get(p.tokens), buf.get(p.lse)
    check(((tok >= 0) & (tok < V)).all() and np.isfinite(lse).all(),
          f"markov_sample {head} {fdt}/{wdt}: tokens in [0, {V}) and finite lse")


def rejection(C, buf, be, rng, R, G, V, tdt, rows="full", coupled=False):
    n = np.full(R, G + 1) if rows == "full" else rng.integers(1, G + 2, R)
    cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    T = np.where(np.arange(R) % 3 == 2, 0.0, rng.uniform(0.3, 2.0, R))
    z = 2 * rng.standard_normal((R, G, V))
    zt = z / np.where(T == 0, 1.0, T)[:, None, None]  # lse of z / T, T = 1 for greedy rows
    m = zt.max(-1)
    lse = m + np.log(np.exp(zt - m[..., None]).sum(-1))
    p = C.RejectionSampleParams()
    p.R, p.gamma, p.V = R, G, V
    p.dtype, p.draft_dtype, p.lse_dtype = DTYPE_CODE[tdt], DTYPE_CODE["float32"], DTYPE_CODE["float32"]
    p.target_logits = buf(as_float(2 * rng.standard_normal((int(cu[-1]), V)), tdt))
    p.cu_rows = buf(cu)
    p.draft_tokens = buf(rng.integers(0, V, (R, G), dtype=np.int64))
    p.draft_logits, p.draft_lse = buf(z.astype(np.float32)), buf(lse.astype(np.float32))
    p.temperature = buf(T.astype(np.float32))
    p.seed, p.stream, p.round = (buf(rng.integers(0, 2**40, R, dtype=np.int64)) for _ in range(3))
    p.coupled = buf((np.arange(R) % 2).astype(np.uint8)) if coupled else 0
    p.num_accepted, p.out_tokens = buf(np.zeros(R, np.int32)), buf(np.full((R, G + 1), -1, np.int64))
    p.failed = buf(np.zeros(R, np.uint8))
    C.rejection_sample(p, be, 0)
    buf.sync()
    acc, out = buf.get(p.num_accepted), buf.get(p.out_tokens)
    check(((acc >= 0) & (acc <= n - 1)).all() and ((out >= -1) & (out < V)).all()
          and (out[np.arange(R), acc] >= 0).all(), f"rejection_sample {tdt}: accepted counts and tokens")


def attention(C, buf, be, rng, n_q, ctx, h_q, h_kv, hd, ps, fdt):
    """One input set, run unplanned and then (CUDA) twice on one plan: the plan's merge tickets
    must be back at zero after a call, and the merge sums splits in a fixed order, so all three
    outputs are the same bits."""
    R, kv = len(n_q), [c + n for c, n in zip(ctx, n_q)]
    need = [-(-L // ps) for L in kv]
    num_pages, max_pages = sum(need) + 2, max(need) + 1  # two pages nobody owns
    perm = rng.permutation(num_pages)
    cache = lambda: np.full((num_pages, ps, h_kv, hd), np.nan, np.float32)
    kc, vc = cache(), cache()
    tables = np.full((R, max_pages), -1, np.int32)
    at = 0
    for r, L in enumerate(kv):
        pages, at = perm[at:at + need[r]], at + need[r]
        tables[r, :need[r]] = pages
        for c in (kc, vc):
            rows = rng.standard_normal((need[r] * ps, h_kv, hd))
            rows[L:] = np.nan  # stale slots past kv_len
            c[pages] = rows.reshape(need[r], ps, h_kv, hd)
    cu = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
    p = C.VerifyAttentionParams()
    p.R, p.h_q, p.h_kv, p.head_dim, p.page_size, p.num_pages = R, h_q, h_kv, hd, ps, num_pages
    p.max_pages, p.dtype, p.causal, p.window, p.scale = max_pages, DTYPE_CODE[fdt], True, 0, 1.25 * hd ** -0.5
    p.batch_invariant = False
    p.cu_q, p.kv_lens = buf(cu), buf(np.array(kv, np.int32))
    p.q = buf(as_float(rng.standard_normal((int(cu[-1]), h_q, hd)), fdt))
    p.k_cache, p.v_cache, p.block_tables = buf(as_float(kc, fdt)), buf(as_float(vc, fdt)), buf(tables)
    zeros = lambda: buf(np.zeros((int(cu[-1]), h_q, hd), np.uint16 if fdt == "bfloat16" else np.float32))
    outs = []
    for planned in [False, True, True] if buf.cuda else [False]:  # the plan exists on CUDA only
        if planned and not p.work:  # the forward's plan: partition and split-KV partials
            slots = C.verify_attention_plan_slots(p, 0)
            if not slots:
                break
            p.work = buf(np.zeros(4 * (R + 1), np.int32))
            p.part_o, p.part_lse = buf(np.zeros((slots, 64, hd), np.float32)), buf(np.zeros((slots, 64), np.float32))
            p.plan_slots = slots
            C.verify_attention_plan(p, 0)
        p.out = zeros()
        C.verify_attention(p, be, 0)
        buf.sync()
        outs.append(buf.get(p.out))
    what = f"verify_attention {fdt} n_q={n_q} ctx={ctx} h_q={h_q} h_kv={h_kv} hd={hd}"
    check(np.isfinite(to_f32(outs[0], fdt)).all(), f"{what}: finite rows (no NaN page leaks)")
    check(all(np.array_equal(o, outs[0]) for o in outs[1:]), f"{what}: planned, replanned and unplanned bits equal")


def prefix_topk(C, buf, be, rng, R, G, K):
    p = C.PrefixTopkParams()
    p.R, p.gamma, p.K = R, G, min(K, R * G)  # ops clamps K to the candidates
    p.survival = buf(np.cumprod(rng.uniform(0.5, 1.0, (R, G)), 1).astype(np.float32))
    p.lengths = buf(np.zeros(R, np.int32))
    C.prefix_topk(p, be, 0)
    buf.sync()
    lengths = buf.get(p.lengths)
    check(int(lengths.sum()) == min(K, R * G) and ((lengths >= 0) & (lengths <= G)).all(),
          "prefix_topk: lengths sum to K")


def append_kv(C, buf, be, rng, N, h_kv, hd, ps, num_pages, fdt):
    slots = rng.permutation(num_pages * ps)[:N].astype(np.int64)
    slots[::3] = -1  # padding rows: not written
    k, v = (as_float(rng.standard_normal((N, h_kv, hd)), fdt) for _ in range(2))
    p = C.AppendKvParams()
    p.N, p.h_kv, p.head_dim, p.page_size, p.num_pages, p.dtype = N, h_kv, hd, ps, num_pages, DTYPE_CODE[fdt]
    p.k, p.v, p.slot_mapping = buf(k), buf(v), buf(slots)
    p.k_cache, p.v_cache = (buf(np.zeros((num_pages, ps, h_kv, hd), k.dtype)) for _ in range(2))
    C.append_kv(p, be, 0)
    buf.sync()
    ok = slots >= 0
    for ptr, want in ((p.k_cache, k), (p.v_cache, v)):
        got = buf.get(ptr).reshape(-1, h_kv, hd)
        check(np.array_equal(got[slots[ok]], want[ok]) and not got[np.setdiff1d(np.arange(len(got)), slots[ok])].any(),
              f"append_kv {fdt}: the rows written where slot_mapping says, nothing else")


def ticket_cases(C, buf, be, rng):
    """The paths where blocks meet through an atomic ticket: verify_attention's split-KV merge
    (the last split of a unit merges; tensor cores: bf16, head_dim 64 / 128) and
    rejection_sample's residual merge (the last of a request's vocabulary chunks). S: the
    planner's splits at 264 blocks (an H200's head_dim-128 grid)."""
    for n_q, ctx, h_q, h_kv, hd in [((1,), (4095,), 32, 8, 128),   # 4 rows a unit: 4 merge groups, S 8
                                    ((2,), (16000,), 2, 1, 64),    # S > 16: two rounds of lse loads
                                    ((8, 3), (2000, 700), 8, 2, 128),  # 32 and 12 rows, ragged
                                    ((20,), (3000,), 8, 2, 128)]:  # 80 rows: two query tiles a head
        rows = [n * (h_q // h_kv) for n in n_q]
        units = [h_kv * -(-r // 64) for r in rows]
        tiles = [-(-(c + n) // 64) for c, n in zip(ctx, n_q)]
        chunk = C.attn_split_chunk(units, tiles, 264)
        print(f"  attention n_q={n_q} ctx={ctx} hd={hd}: S {[-(-t // chunk) for t in tiles]}", flush=True)
        attention(C, buf, be, rng, n_q, ctx, h_q, h_kv, hd, 16, "bfloat16" if buf.cuda else "float32")
    for V in (9000, 3 * 8192 + 100):  # 2 and 4 chunks (the last one short)
        print(f"  rejection V={V}", flush=True)
        rejection(C, buf, be, rng, 4, 3, V, "float32", rows="random")
        rejection(C, buf, be, rng, 3, 2, V, "bfloat16", coupled=True)


def all_cases(C, buf, be, rng):
    # dtypes each backend's kernels take (ops.door.float_dtypes, ops.markov._MARKOV_MIXED,
    # ops.rejection._REJECTION_MIXED)
    same = ["float32", "bfloat16"] if buf.cuda else ["float32"]
    for dt in same:  # logits and weights alike
        print(f"  {dt}: markov, rejection, append_kv", flush=True)
        markov(C, buf, be, rng, 3, 2, 1100, 32, 24, "gated", dt, dt)
        markov(C, buf, be, rng, 2, 2, 700, 20, 16, "vanilla", dt, dt)
        markov(C, buf, be, rng, 3, 2, 700, 20, 16, "vanilla", dt, dt, temps="mixed", coupled=True)
        rejection(C, buf, be, rng, 4, 3, 9000, dt, rows="random")
        rejection(C, buf, be, rng, 3, 2, 1000, dt)
        rejection(C, buf, be, rng, 4, 3, 9000, dt, rows="random", coupled=True)
        append_kv(C, buf, be, rng, 10, 2, 64, 8, 4, dt)
    # a bf16 model as served: float32 logits over bf16 weights / target rows
    markov(C, buf, be, rng, 3, 2, 1100, 32, 24, "gated", "float32", "bfloat16")
    rejection(C, buf, be, rng, 3, 2, 1000, "bfloat16")
    if buf.cuda:
        markov(C, buf, be, rng, 3, 2, 1100, 64, 24, "vanilla", "float32", "bfloat16", u16=True)
    for dt in same:
        print(f"  {dt}: verify_attention", flush=True)
        attention(C, buf, be, rng, (2, 1), (300, 40), 8, 2, 128, 16, dt)
        attention(C, buf, be, rng, (3,), (1100,), 4, 2, 64, 16, dt)
        attention(C, buf, be, rng, (2,), (30,), 4, 2, 32, 8, dt)
    print("  prefix_topk", flush=True)
    prefix_topk(C, buf, be, rng, 50, 7, 100)
    prefix_topk(C, buf, be, rng, 3, 16, 1000)  # K past every candidate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--cases", choices=["all", "tickets"], default="all",
                    help="tickets: only the calls whose blocks meet through an atomic ticket (cheap)")
    ap.add_argument("--seed", type=int, default=1701)
    args = ap.parse_args(argv)
    C, cuda = load_c(), args.device == "cuda"
    if cuda and not C.build_info().get("cuda"):
        sys.exit(f"sanitize_ops: this _C has no CUDA kernels ({C.build_info()})")
    be, buf, rng = ("cuda" if cuda else "cpp"), Buffers(cuda), np.random.default_rng(args.seed)
    print(f"sanitize_ops: {args.cases} cases, {be}", flush=True)
    ticket_cases(C, buf, be, rng)
    if args.cases == "all":
        all_cases(C, buf, be, rng)
    buf.sync()
    print("sanitize-ok")


if __name__ == "__main__":
    main()
