"""CUDA graphs per bucket (dspark_rt/runner/graphs.py).

CPU: the padded fixed-buffer path, run eagerly (capture=False), against the unpadded forward the
runner runs (target.forward for verify, Runner.draft for draft) on the tiny fixture models in
float64 and float32, for ragged batches: padded with rows and requests, landing exactly on a
bucket, reusing the buffers after a larger batch (stale entries must be overwritten), and
falling back to eager. The caches are NaN-poisoned outside the context each request owns, so a
padding row that wrote its K/V (or a real row that did not) changes the NaN pattern.
Graphs (the "cuda" cases are marked gpu): the same comparisons through captured graphs and
replays, replays after the metadata changed, the fallback, capture_all, one shared pool, and a
bfloat16 head_dim-64 model that takes the tensor-core attention (whose scratch is
cudaMallocAsync'ed inside the capture). The "cpu-fake" cases run the same tests on the CPU with
a stand-in graph (replay recomputes into the captured outputs) to check the bookkeeping.

Tolerance: a real row sees exactly the inputs it sees unpadded; only the GEMM heights change
(N_b rows instead of N), and a BLAS may then block the reduction differently and sum a row's
products in another order. One reassociation of a length-K dot product moves it by at most
~K * eps of sum |a_i b_i|; the tiny models (K <= 128, three layers of O(1) gain) keep that far
below TOL_ULPS = 64 eps of the output's scale (observed on this CPU: float64 bitwise equal,
float32 within 2.2 eps). Layout bugs (a wrong row, a stale slot, a padding write, a request
attending the wrong pages) move outputs by O(scale): 10^5 times more in float32, 10^13 in
float64. Integer outputs (drafted tokens) must be equal.
"""
import math

import pytest
import torch

from dspark_rt import ops, testing
from dspark_rt.runner import graphs
from dspark_rt.runner.graphs import GraphRunner, StaticBatch, capture_problem, default_buckets
from dspark_rt.models.batch import AttnMeta
from dspark_rt.models.drafter import Drafter
from dspark_rt.models.qwen3 import Qwen3Model
from dspark_rt.batch import SamplingBatch, SeqBatch
from dspark_rt.runner import Runner
from dspark_rt.sampling_params import SamplingParams

PAGE = 4
NUM_PAGES = 96
MAX_BATCH = 8  # draft buckets [1, 2, 4, 8]; verify buckets up to 8 * (gamma + 1)
TOL_ULPS = 64
F64, F32 = torch.float64, torch.float32


def _cuda_ready():
    return torch.cuda.is_available() and "cuda" in ops.available_backends()


needs_gpu = pytest.mark.skipif(not _cuda_ready(), reason="needs a GPU and a CUDA build of _C")


# -- set-up ----------------------------------------------------------------------------------

def _runner(target_dir, drafter_dir, kind, dtype, device="cpu") -> Runner:
    t = Qwen3Model.from_pretrained(str(target_dir), dtype=dtype, device=device)
    d = Drafter.from_pretrained(str(drafter_dir), t) if drafter_dir else None
    mode = "ar" if d is None else "dflash" if kind in ("none", "zlab") else "dspark"
    run = Runner(t, d, mode, PAGE, torch.device(device))
    run.allocate_caches(NUM_PAGES)
    return run


def _meta(run, pages, starts, counts, causal):
    """The runner's own metadata (its meta returns (meta, positions, cu))."""
    return run.meta(pages, starts, counts, causal)[:2]


def _hand_out(g, ends, spare=0):
    """Page lists of ceil(end / PAGE) (+ spare) pages each, in a random order."""
    perm = torch.randperm(NUM_PAGES, generator=g).tolist()
    out, k = [], 0
    for e in ends:
        n = -(-e // PAGE) + spare
        out.append(perm[k : k + n])
        k += n
    assert k <= NUM_PAGES
    return out


def _poison(cache, pages, context_lens, g):
    """Every slot NaN except positions 0 .. context_len-1 of each request: random K/V."""
    cache.fill_(math.nan)
    L, _, _, h, hd = cache.k_all.shape
    k, v = cache.k_all.view(L, -1, h, hd), cache.v_all.view(L, -1, h, hd)
    for pl, n in zip(pages, context_lens):
        if n:
            slots = torch.tensor([pl[p // PAGE] * PAGE + p % PAGE for p in range(n)], device=k.device)
            k[:, slots] = torch.randn(L, n, h, hd, generator=g, dtype=F64).to(k)
            v[:, slots] = torch.randn(L, n, h, hd, generator=g, dtype=F64).to(v)


def _snapshot(cache):
    return cache.k_all.clone(), cache.v_all.clone()


def _restore(cache, snap):
    cache.k_all.copy_(snap[0])
    cache.v_all.copy_(snap[1])


def _tol(ref):
    eps = torch.finfo(ref.dtype).eps
    return TOL_ULPS * eps * max(1.0, float(ref.abs().max()))


def _close(got, ref, what):
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0
    assert err <= _tol(ref), f"{what}: max error {err:.3g} > {_tol(ref):.3g}"


def _same_cache(got, ref):
    """Same NaN pattern (nothing written that the unpadded run did not write, and the reverse),
    values close where written."""
    for a, b, name in ((got.k_all, ref[0], "k"), (got.v_all, ref[1], "v")):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name} cache: NaN pattern differs"
        ok = ~torch.isnan(b)
        _close(a[ok], b[ok], f"{name} cache")


# -- verify ------------------------------------------------------------------------------------

def _verify_case(run, gr, g, starts, counts, spare=0):
    """One verify batch through gr and through the unpadded target.forward, on the same
    poisoned cache; returns gr's stats delta."""
    pages = _hand_out(g, [s + n for s, n in zip(starts, counts)], spare)
    _poison(run.tcache, pages, starts, g)
    meta, pos = _meta(run, pages, starts, counts, True)
    V = run.target.config.vocab_size
    ids = torch.randint(0, V, (sum(counts),), generator=g).to(run.device)
    before = _snapshot(run.tcache)
    ref_logits, ref_feats = run.target.forward(ids, pos, meta, run.tcache, capture_layers=run.capture)
    ref_cache = _snapshot(run.tcache)
    _restore(run.tcache, before)
    stats = dict(gr.stats)
    logits, feats = gr.verify(ids, pos, meta, run.tcache)
    _close(logits, ref_logits, "logits")
    if ref_feats is None:
        assert feats is None
    else:
        _close(feats, ref_feats, "features")
    _same_cache(run.tcache, ref_cache)
    return {k: gr.stats[k] - stats[k] for k in stats}


def _ragged(g, R, max_start=14, max_count=5):
    starts = torch.randint(0, max_start, (R,), generator=g).tolist()
    counts = torch.randint(1, max_count + 1, (R,), generator=g).tolist()
    return starts, counts


def _verify_sequence(run, gr, g):
    """Batches chosen against the buckets; asserts which path each took."""
    assert gr.verify_buckets[:6] == [1, 2, 4, 8, 16, 24]
    top = gr.verify_buckets[-1]
    cases = [  # (starts, counts, path)
        ([3, 0, 9, 1], [5, 4, 1, 3], "padded"),     # N = 13 -> 16: 3 padding rows, 4 padding requests
        ([7, 2], [4, 5], "padded"),                 # N = 9 -> 16 again: stale rows and requests
        ([1] * 8, [2] * 8, "padded"),               # N = 16 = a bucket, R = R_b = 8
        ([5], [1], "padded"),                       # N = 1
        ([2] * 8, [top // 8 + 1] * 8, "eager"),     # N = top + 8 > every bucket
        ([0, 12, 4], [24, 1, 1], "padded"),         # N = 26 -> 32, long chain
    ]
    for seed in range(3):  # random ragged batches
        starts, counts = _ragged(torch.Generator().manual_seed(seed), 1 + seed * 3)
        cases.append((starts, counts, "padded"))
    for starts, counts, path in cases:
        d = _verify_case(run, gr, g, starts, counts, spare=1)
        assert d[f"verify_{path}"] == 1, (starts, counts, d)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_verify_padded_equals_unpadded(tiny_target, tiny_drafters, dtype):
    run = _runner(tiny_target, tiny_drafters("vanilla", 4), "vanilla", dtype)
    gr = GraphRunner.from_runner(run, capture=False, max_batch=MAX_BATCH)
    _verify_sequence(run, gr, torch.Generator().manual_seed(11))


def test_verify_without_features_and_wide_tables(tiny_target):
    """Plain decoding (no features) and a block table wider than the buffers (eager)."""
    run = _runner(tiny_target, None, "ar", F32)
    gr = GraphRunner.from_runner(run, capture=False, max_batch=MAX_BATCH, max_pages=3)
    g = torch.Generator().manual_seed(3)
    assert _verify_case(run, gr, g, [2, 5, 0], [1, 1, 1])["verify_padded"] == 1
    assert _verify_case(run, gr, g, [2, 9, 0], [1, 1, 1], spare=1)["verify_eager"] == 1  # 4 pages


# -- draft -------------------------------------------------------------------------------------

def _requests(g, R, B, V):
    """A SeqBatch of R requests with drafter contexts of random length, mixed greedy / sampled
    (drafter pages set by the caller)."""
    ctx = [int(torch.randint(1, 14, (1,), generator=g)) for _ in range(R)]
    anchors = [int(torch.randint(0, V, (1,), generator=g)) for _ in range(R)]
    rounds = [int(torch.randint(0, 5, (1,), generator=g)) for _ in range(R)]
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], max_tokens=64, coupled=i % 4 == 1)
              for i in range(R)]
    return SeqBatch(ctx, list(ctx), [[] for _ in range(R)], [[] for _ in range(R)], anchors,
                    [B] * R, SamplingBatch.of(params), [1000 + i for i in range(R)], [i % 2 for i in range(R)], rounds)


def _draft_case(run, gr, g, R, spare=0):
    B, V = run.drafter.block_size, run.target.config.vocab_size
    batch = _requests(g, R, B, V)
    pages = _hand_out(g, [c + B for c in batch.ctx_lens], spare)
    batch.drafter_pages = [list(pl) for pl in pages]
    _poison(run.dcache, pages, batch.ctx_lens, g)
    before = _snapshot(run.dcache)
    ref = run.draft(batch, run.rng(batch))
    ref_cache = _snapshot(run.dcache)
    _restore(run.dcache, before)
    meta, pos = _meta(run, pages, batch.ctx_lens, [B] * R, False)
    anchor = torch.tensor(batch.anchors, dtype=torch.int64, device=run.device)
    stats = dict(gr.stats)
    got = gr.draft(anchor, pos, meta, run.dcache, run.rng(batch))
    assert torch.equal(got[0], ref.tokens), "drafted tokens differ"
    for name, a, b in zip(("z", "lse", "conf_logit"), got[1:], (ref.z, ref.lse, ref.conf_logit)):
        if b is not None:  # no confidence head: the runner reports none
            _close(a, b, name)
    _same_cache(run.dcache, ref_cache)
    return {k: gr.stats[k] - stats[k] for k in stats}


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("kind", ["vanilla", "gated", "zlab"])
def test_draft_padded_equals_runner(tiny_target, tiny_drafters, kind, dtype):
    run = _runner(tiny_target, tiny_drafters(kind, 4), kind, dtype)
    gr = GraphRunner.from_runner(run, capture=False, max_batch=MAX_BATCH)
    assert gr.draft_buckets == [1, 2, 4, 8]
    g = torch.Generator().manual_seed(5)
    for R, path in ((3, "padded"), (1, "padded"), (4, "padded"), (2, "padded"), (6, "padded"),
                    (9, "eager"), (8, "padded")):
        d = _draft_case(run, gr, g, R, spare=R % 2)
        assert d[f"draft_{path}"] == 1, (R, d)


def test_padding_rows_holding_nan(tiny_target, tiny_drafters, monkeypatch):
    """The kernels leave attention rows of no request unwritten: they may hold anything, NaN
    included. Real rows must not see it, and padding requests must still draft finite logits
    and in-range tokens (a NaN argmax could index w1 out of range in the sequential loop)."""
    real = ops.verify_attention

    def nan_past_last_request(q, cu_q, *a, **kw):
        out = real(q, cu_q, *a, **kw)
        out[int(cu_q[-1]):] = math.nan
        return out

    monkeypatch.setattr(ops, "verify_attention", nan_past_last_request)
    run = _runner(tiny_target, tiny_drafters("gated", 4), "gated", F32)
    gr = GraphRunner.from_runner(run, capture=False, max_batch=MAX_BATCH)
    g = torch.Generator().manual_seed(2)
    assert _verify_case(run, gr, g, [3, 0, 9], [5, 4, 1])["verify_padded"] == 1
    assert _draft_case(run, gr, g, 5)["draft_padded"] == 1
    V = run.target.config.vocab_size
    assert torch.isfinite(gr.z_out).all() and torch.isfinite(gr.lse_out).all()
    assert 0 <= int(gr.tokens_out.min()) and int(gr.tokens_out.max()) < V


# -- pieces --------------------------------------------------------------------------------------

def test_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    b = default_buckets(512)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 512 and b == sorted(set(b))
    assert all(b[i + 1] - b[i] <= max(8, b[i] // 4) for i in range(3, len(b) - 1))
    assert GraphRunner._pick([1, 4, 8], 4) == 4 and GraphRunner._pick([1, 4, 8], 5) == 8
    assert GraphRunner._pick([1, 4, 8], 9) is None


def test_static_batch_padding():
    """The padded layout, entry by entry, after a larger batch left stale values."""
    sb = StaticBatch(8, 4, 5, "cpu")
    big = AttnMeta(torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([9, 4], dtype=torch.int32),
                   torch.tensor([[5, 6, 7], [8, 0, 0]], dtype=torch.int32),
                   torch.arange(20, 27, dtype=torch.int64), True)
    sb.load(8, 4, torch.arange(7), big, ids=torch.arange(1, 8))
    small = AttnMeta(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                     torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([13, 14]), True)
    sb.load(4, 3, torch.tensor([4, 5]), small, ids=torch.tensor([9, 8]))
    ids, pos, meta = sb.view(4, 3, True)
    assert ids.tolist() == [9, 8, 0, 0] and pos.tolist() == [4, 5, 0, 0]
    assert meta.slot_mapping.tolist() == [13, 14, -1, -1]
    assert meta.cu_q.tolist() == [0, 2, 2, 2] and meta.kv_lens.tolist() == [6, 0, 0]
    assert meta.block_tables.tolist() == [[3, 1, 0, 0, 0], [0] * 5, [0] * 5]


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_attention_rows_past_the_last_request(backend):
    """Padding rows owned by no request (cu_q ends before N) and padding requests (0 queries,
    kv_len 0, table of 0s) leave the real rows exactly as without them."""
    if backend not in ops.available_backends():
        pytest.skip(f"no {backend} backend")
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(6, 4, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(5, 4, 16, generator=g)
    bt = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    args = dict(k_cache=kc, v_cache=vc, backend=backend)
    ref = ops.verify_attention(q, torch.tensor([0, 2, 5], dtype=torch.int32), block_tables=bt,
                               kv_lens=torch.tensor([6, 7], dtype=torch.int32), **args)
    qp = torch.cat([q, torch.randn(3, 4, 16, generator=g)])
    got = ops.verify_attention(qp, torch.tensor([0, 2, 5, 5, 5], dtype=torch.int32),
                               block_tables=torch.cat([bt, torch.zeros(2, 2, dtype=torch.int32)]),
                               kv_lens=torch.tensor([6, 7, 0, 0], dtype=torch.int32), **args)
    assert torch.equal(got[:5], ref)
    if backend == "reference":
        assert not got[5:].any()


def test_capture_needs_cuda(tiny_target):
    run = _runner(tiny_target, None, "ar", F32)
    assert capture_problem(run.target)
    with pytest.raises(ValueError, match="cannot capture"):
        GraphRunner.from_runner(run)


# -- graphs: real on a GPU, simulated on the CPU -------------------------------------------------

class _FakeGraph:
    """A graph as the runner sees one: replay recomputes into the captured output tensors."""

    def __init__(self, bucket, pool):
        self.bucket, self._pool = bucket, pool

    def replay(self):
        for old, new in zip(self.bucket.out, self.bucket.fn()):
            if old is not None:
                old.copy_(new)

    def pool(self):
        return self._pool


def _fake_capture(self, bucket):
    """Warm-ups, then the outputs the capture allocates; a real capture computes nothing, so they
    are scribbled over (a result read before its replay would show)."""
    for _ in range(self.warmup):
        bucket.fn()
    out = bucket.fn()
    for t in out:
        if t is not None and t.is_floating_point():
            t.fill_(math.nan)
    bucket.graph, bucket.out = _FakeGraph(bucket, self.pool), out
    self.stats["captures"] += 1


@pytest.fixture(params=["cpu-fake", pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu])])
def graph_device(request, monkeypatch):
    """"cuda": real graphs (matmuls without TF32: tolerances are argued in float32 units).
    "cpu-fake": GraphRunner's bookkeeping (lazy capture, replays into fixed outputs, capture_all,
    recapture on a new cache, one pool) with _FakeGraph on the CPU."""
    if request.param == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        return "cuda"
    _fake_graphs(monkeypatch)
    return "cpu"


def _fake_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "capture_problem", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("fake pool", 0))
    monkeypatch.setattr(GraphRunner, "_capture", _fake_capture)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def test_replay_verify(tiny_target, tiny_drafters, graph_device):
    run = _runner(tiny_target, tiny_drafters("vanilla", 4), "vanilla", F32, graph_device)
    gr = GraphRunner.from_runner(run, max_batch=MAX_BATCH)
    g = torch.Generator().manual_seed(21)
    _verify_sequence(run, gr, g)
    # several batches per bucket: new requests, longer contexts, replayed without recapture
    for i, ctx in enumerate((3, 11, 17, 30)):
        _verify_case(run, gr, g, [ctx, ctx + 2, 1], [4, 4, 5])          # 13 -> 16
        _verify_case(run, gr, g, [ctx] * 5, [4, 4, 4, 5, 3], spare=1)   # 20 -> 24
        if i == 0:
            captured = gr.stats["captures"]
    assert gr.stats["captures"] == captured
    assert gr.graphs() and all(gg.pool() == gr.pool for gg in gr.graphs())


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn", "zlab"])
def test_replay_draft(tiny_target, tiny_drafters, kind, graph_device):
    run = _runner(tiny_target, tiny_drafters(kind, 4), kind, F32, graph_device)
    gr = GraphRunner.from_runner(run, max_batch=MAX_BATCH)
    g = torch.Generator().manual_seed(8)
    for R, path in ((3, "padded"), (4, "padded"), (2, "padded"), (3, "padded"), (9, "eager"),
                    (6, "padded"), (7, "padded"), (1, "padded")):
        d = _draft_case(run, gr, g, R, spare=R % 2)
        path = "eager" if kind == "rnn" else path  # rnn drafts run the reference, uncaptured
        assert d[f"draft_{path}"] == 1, (R, d)
    assert gr.stats["captures"] == (0 if kind == "rnn" else 4)  # buckets 4, 2, 8, 1
    # the round's other half through the same pool: the draft outputs survive a verify replay
    drafted = gr.draft(*_draft_inputs(run, g, 3))
    keep = [t.clone() for t in drafted]
    assert all(bool(torch.isfinite(t).all()) for t in keep)
    _verify_case(run, gr, g, [2, 3, 4], [5, 5, 3])
    for a, b in zip(drafted, keep):
        assert torch.equal(a, b), "a verify replay overwrote the draft outputs"
    assert all(gg.pool() == gr.pool for gg in gr.graphs())


def _draft_inputs(run, g, R):
    B, V = run.drafter.block_size, run.target.config.vocab_size
    batch = _requests(g, R, B, V)
    pages = _hand_out(g, [c + B for c in batch.ctx_lens])
    _poison(run.dcache, pages, batch.ctx_lens, g)
    meta, pos = _meta(run, pages, batch.ctx_lens, [B] * R, False)
    anchor = torch.tensor(batch.anchors, dtype=torch.int64, device=run.device)
    return anchor, pos, meta, run.dcache, run.rng(batch)


def test_capture_all_writes_nothing(tiny_target, tiny_drafters, graph_device):
    run = _runner(tiny_target, tiny_drafters("vanilla", 4), "vanilla", F32, graph_device)
    gr = GraphRunner.from_runner(run, max_batch=MAX_BATCH)
    run.tcache.fill_(7.0)
    run.dcache.fill_(7.0)
    gr.capture_all(run.tcache, run.dcache)
    n = len(gr.verify_buckets) + len(gr.draft_buckets)
    assert gr.stats["captures"] == n and len(gr.graphs()) == n
    gr.capture_all(run.tcache, run.dcache)
    assert gr.stats["captures"] == n  # nothing captured twice
    _sync(graph_device)
    for t in (run.tcache.k_all, run.tcache.v_all, run.dcache.k_all, run.dcache.v_all):
        assert (t == 7.0).all(), "capturing over all-padding batches wrote the caches"
    g = torch.Generator().manual_seed(4)
    _verify_case(run, gr, g, [3, 0, 9], [5, 4, 1])
    _draft_case(run, gr, g, 3)
    assert gr.stats["captures"] == n  # replays only
    assert all(gg.pool() == gr.pool for gg in gr.graphs())
    # a new cache object drops the graphs: they captured the old addresses
    old = run.tcache
    run.allocate_caches(NUM_PAGES)
    assert run.tcache is not old
    _verify_case(run, gr, g, [3, 0], [5, 4])
    assert len(gr.graphs()) == 1


def test_rnn_drafts_stay_eager(tiny_target, tiny_drafters, monkeypatch):
    """The rnn head has no CUDA markov_sample: its drafts run eagerly, its verify is captured."""
    _fake_graphs(monkeypatch)
    run = _runner(tiny_target, tiny_drafters("rnn", 4), "rnn", F32)
    gr = GraphRunner.from_runner(run, max_batch=MAX_BATCH)
    g = torch.Generator().manual_seed(6)
    assert _draft_case(run, gr, g, 3)["draft_eager"] == 1
    assert _verify_case(run, gr, g, [3, 0, 9], [5, 4, 1])["verify_padded"] == 1
    gr.capture_all(run.tcache, run.dcache)
    assert len(gr.graphs()) == len(gr.verify_buckets)


@pytest.mark.gpu
@needs_gpu
def test_gpu_bf16_tensor_core_attention(tmp_path):
    """head_dim 64 in bfloat16: the tensor-core attention with its plan / split / merge kernels
    and cudaMallocAsync scratch inside the capture. Replay against the same padded path run
    eagerly (same shapes: same kernels), and loosely against the unpadded forward (bfloat16
    roundings of GEMMs of another height may differ by an ulp and compound over the layers)."""
    testing.write_tiny_target(tmp_path / "t", seed=2, vocab=96, hidden=256, layers=2, heads=4,
                              kv_heads=2, head_dim=64)
    run = _runner(tmp_path / "t", None, "ar", torch.bfloat16, "cuda")
    graphed = GraphRunner.from_runner(run, max_batch=16, max_verify_tokens=64)
    eager = GraphRunner.from_runner(run, max_batch=16, max_verify_tokens=64, capture=False)
    g = torch.Generator().manual_seed(9)
    for starts, counts in (([40, 3, 70], [1, 1, 1]), ([100, 9, 0, 33, 64], [1] * 5),
                           ([7] * 13, [1] * 13), ([150, 2], [1, 1])):
        pages = _hand_out(g, [s + n for s, n in zip(starts, counts)])
        _poison(run.tcache, pages, starts, g)
        meta, pos = _meta(run, pages, starts, counts, True)
        ids = torch.randint(0, 96, (sum(counts),), generator=g).to(run.device)
        snap = _snapshot(run.tcache)
        ref, _ = run.target.forward(ids, pos, meta, run.tcache)
        _restore(run.tcache, snap)
        pad, _ = eager.verify(ids, pos, meta, run.tcache)
        _restore(run.tcache, snap)
        got, _ = graphed.verify(ids, pos, meta, run.tcache)
        scale = float(ref.abs().max())
        assert float((got - pad).abs().max()) <= 4 * 2.0 ** -7 * scale  # expected: bitwise equal
        assert float((got - ref).abs().max()) <= 0.05 * scale
    assert graphed.stats["verify_padded"] == 4 and graphed.stats["captures"] == 4
