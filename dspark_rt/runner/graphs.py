"""CUDA graphs per bucket for the runner's two per-round forwards (DSPARK_CUDA_GRAPHS).

verify: the target forward over a round's flat verify batch, captured per bucket of total verify
tokens N_b, with R_b = min(N_b, max_batch) request slots (every request verifies >= 1 token).
draft: the drafter's block forward, the LM head and ops.markov_sample (the sequential loop),
captured per batch-size bucket R_b (N_b = R_b * block_size rows).
All captures share one memory pool. A graph replays fixed addresses, so its inputs travel through
fixed device buffers (StaticBatch) that each call fills, padded up to the bucket:
    padding rows      id 0, position 0, slot -1 (their K/V are never written), owned by no
                      request: cu_q ends at the real row count, rows past it are not attended;
    padding requests  0 queries (cu_q repeats its last value), kv_len 0, block-table row of 0s;
    block tables      real tables in the first columns of a [max_batch, max_pages] buffer.
Padding rows compute garbage (never NaN-checked, never read back); rows do not mix outside
attention, so the real rows are exactly what the unpadded forward gives, up to the float
reassociation of GEMMs of another height. A batch outside every bucket (more tokens, requests or
block-table columns than the buffers hold) runs the runner's eager computation instead.

capture=False runs the same padded fixed-buffer path eagerly, on any device: the tests check the
layout on the CPU with it. Production builds a GraphRunner only on CUDA (see Runner).

Lifetimes: verify() returns views of its graph's output, valid until the next verify() or
draft(); draft() returns views of buffers allocated outside the pool (a later capture may place
its temporaries where a verify graph's live in the shared pool, never where these are), valid
until the next draft(). The caches and weights are captured by address: a new cache object
drops every graph (and the pool) and captures again.
"""
import bisect
import os

import torch

from .. import ops
from ..models.batch import AttnMeta
from ..batch import pages_for
from .forward import draft_forward

__all__ = ["GraphRunner", "StaticBatch", "default_buckets", "capture_problem"]


def default_buckets(limit: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 to 64, of 16 to 128, of 32 to 256, of 64 beyond, and
    `limit` itself: sizes whose padding costs at most about a quarter of the batch."""
    if limit < 1:
        raise ValueError(f"default_buckets: limit must be >= 1, got {limit}")
    out, b = [], 1
    while b < limit:
        out.append(b)
        step = 8 if b < 64 else 16 if b < 128 else 32 if b < 256 else 64
        b = b * 2 if b < 8 else b + step
    return out + [limit]


def capture_problem(target) -> str | None:
    """Why the forwards of this model cannot be captured on its device (None: they can). Capture
    needs the CUDA kernels (the reference ops read device tensors on the host)."""
    if target.device.type != "cuda":
        return f"the model is on {target.device}, CUDA graphs need a CUDA device"
    if "cuda" not in ops.available_backends():
        return "this build of dspark_rt._C has no CUDA kernels"
    if os.environ.get("DSPARK_BACKEND", "cuda") != "cuda":
        return f"DSPARK_BACKEND={os.environ['DSPARK_BACKEND']} forces host-syncing ops"
    if target.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the CUDA kernels do not take {target.dtype}"
    return None


class StaticBatch:
    """Fixed device buffers for a flat ragged batch of up to max_rows rows over max_batch
    requests whose block tables have up to max_pages columns:
    ids, positions [max_rows] int64; slots [max_rows] int64; cu_q [max_batch + 1] int32;
    kv_lens [max_batch] int32; block_tables [max_batch, max_pages] int32."""

    def __init__(self, max_rows: int, max_batch: int, max_pages: int, device):
        self.max_rows, self.max_batch, self.max_pages = max_rows, max_batch, max_pages
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(max_rows, **i64)
        self.positions = torch.zeros(max_rows, **i64)
        self.slots = torch.full((max_rows,), -1, **i64)
        self.cu_q = torch.zeros(max_batch + 1, **i32)
        self.kv_lens = torch.zeros(max_batch, **i32)
        self.block_tables = torch.zeros(max_batch, max_pages, **i32)

    def load(self, rows: int, batch: int, positions, meta: AttnMeta, ids=None):
        """Copies a real batch (n rows, r requests, w table columns) into the first entries and
        pads up to `rows` rows and `batch` requests (see the module doc). Device-to-device copies
        and fills only: no host sync."""
        n, r, w = positions.shape[0], meta.kv_lens.shape[0], meta.block_tables.shape[1]
        if ids is not None:
            self.ids[:n].copy_(ids)
            self.ids[n:rows].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:rows].zero_()
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:rows].fill_(-1)
        self.cu_q[: r + 1].copy_(meta.cu_q)
        self.cu_q[r + 1 : batch + 1].copy_(meta.cu_q[r:].expand(batch - r))  # 0 queries each
        self.kv_lens[:r].copy_(meta.kv_lens)
        self.kv_lens[r:batch].zero_()
        self.block_tables[:r, :w].copy_(meta.block_tables)
        self.block_tables[:r, w:].zero_()
        self.block_tables[r:batch].zero_()

    def view(self, rows: int, batch: int, causal: bool):
        """(ids [rows], positions [rows], AttnMeta over batch requests): contiguous leading slices
        of the buffers, the same addresses at every call."""
        meta = AttnMeta(self.cu_q[: batch + 1], self.kv_lens[:batch], self.block_tables[:batch],
                        self.slots[:rows], causal)
        return self.ids[:rows], self.positions[:rows], meta


class _Bucket:
    """One bucket's padded computation `fn` (reading the static buffers) and, once captured, its
    graph and static outputs."""

    def __init__(self, fn):
        self.fn, self.graph, self.out = fn, None, None


class GraphRunner:
    """The runner's verify and draft forwards, padded into buckets, replayed from CUDA graphs.

    target, drafter: the models (drafter None for plain decoding: verify only). capture_layers:
    the target layers whose outputs form the drafter features (None: no features). logits_dtype:
    float32 (float64 for float64 models); verify_dtype: of the verify logits (default
    logits_dtype; Runner.verify_dtype). head, head_weights, head_dtype: what ops.markov_sample
    takes (head_dtype: of the weights and the hidden states; default logits_dtype).
    max_pages: block-table columns the buffers hold. verify_buckets: total verify tokens;
    draft_buckets: batch sizes (both default to default_buckets of max_verify_tokens /
    max_batch). capture=False: run the padded path eagerly (tests, any device).
    warmup: eager runs on a side stream before each capture.
    """

    def __init__(self, target, drafter, *, capture_layers, logits_dtype, verify_dtype=None, head="none",
                 head_weights=None, head_dtype=None, max_pages: int, max_batch: int = 64,
                 max_verify_tokens: int = 512, verify_buckets=None, draft_buckets=None,
                 capture: bool = True, warmup: int = 2):
        if capture:
            why = capture_problem(target)
            if why:
                raise ValueError(f"GraphRunner: cannot capture: {why}")
        self.target, self.drafter = target, drafter
        self.capture_layers = list(capture_layers) if capture_layers else None
        self.logits_dtype, self.head = logits_dtype, head
        self.verify_dtype = verify_dtype or logits_dtype
        self.head_dtype = head_dtype or logits_dtype
        self.head_weights = dict(head_weights or {})
        if capture and warmup < 1:
            raise ValueError("GraphRunner: warmup must be >= 1 (one-time set-up such as cuBLAS "
                             "workspaces must not happen inside a capture)")
        self.capture, self.warmup = capture, warmup
        # the rnn head has no CUDA kernel (the ops door routes it to the host-syncing
        # reference, ops.markov._markov_backend), nor a selector with more candidates than the kernel
        # keeps: their drafts stay eager, the verify is still captured
        wide = head == "selector" and self.head_weights.get("top_k", 0) > ops._CUDA_SELECT_MAX_TOP_K
        self.draft_capturable = not (capture and (head == "rnn" or wide))
        self.device = target.device
        self.verify_buckets = sorted(set(verify_buckets or default_buckets(max_verify_tokens)))
        self.draft_buckets = sorted(set(draft_buckets or default_buckets(max_batch)))
        n_max = self.verify_buckets[-1]
        self.vbuf = StaticBatch(n_max, min(max_batch, n_max), max_pages, self.device)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._verify: dict[int, _Bucket] = {}
        self._draft: dict[int, _Bucket] = {}
        self._tcache = self._dcache = None
        # calls per path; captures counts graphs captured (tests and logs read these)
        self.stats = dict(verify_padded=0, verify_eager=0, draft_padded=0, draft_eager=0, captures=0)
        if drafter is not None:
            self._init_draft_buffers(max_pages)

    @classmethod
    def from_runner(cls, runner, **kw):
        """A GraphRunner for a Runner's models, mode and page size (keywords override)."""
        # the widest block table: a chain or a drafter block reaching past the context's end
        reach = max(runner.gamma + 1, runner.block_size)
        args = dict(capture_layers=runner.capture, logits_dtype=runner.logits_dtype,
                    verify_dtype=runner.verify_dtype,
                    head=runner.head, head_weights=runner.head_weights, head_dtype=runner.head_dtype,
                    max_pages=pages_for(runner.max_len + reach, runner.page_size),
                    max_batch=128,
                    max_verify_tokens=min(1024, kw.get("max_batch", 128) * (runner.gamma + 1)))
        args.update(kw)
        return cls(runner.target, runner.drafter, **args)

    def _init_draft_buffers(self, max_pages):
        d, dev = self.drafter, self.device
        self.block_size, self.gamma = d.block_size, d.gamma
        r_max = self.draft_buckets[-1]
        self.dbuf = StaticBatch(r_max * self.block_size, r_max, max_pages, dev)
        i64 = dict(dtype=torch.int64, device=dev)
        self.anchor = torch.zeros(r_max, **i64)
        self.rng = dict(temperature=torch.zeros(r_max, dtype=torch.float32, device=dev),
                        seed=torch.zeros(r_max, **i64), stream=torch.zeros(r_max, **i64),
                        round_=torch.zeros(r_max, **i64),
                        coupled=torch.zeros(r_max, dtype=torch.uint8, device=dev))
        V = self.target.config.vocab_size
        # outputs: [max_batch, gamma] tokens / lse / conf_logit and [max_batch, gamma, V] z,
        # allocated here, outside the graph pool
        self.tokens_out = torch.zeros(r_max, self.gamma, **i64)
        self.z_out = torch.zeros(r_max, self.gamma, V, dtype=self.logits_dtype, device=dev)
        self.lse_out = torch.zeros(r_max, self.gamma, dtype=self.logits_dtype, device=dev)
        self.conf_out = torch.zeros(r_max, self.gamma, dtype=self.logits_dtype, device=dev)

    # -- buckets and capture -----------------------------------------------------------------

    @staticmethod
    def _pick(buckets, n):
        """The smallest bucket >= n, or None."""
        i = bisect.bisect_left(buckets, n)
        return buckets[i] if i < len(buckets) else None

    def _bind(self, tcache=None, dcache=None):
        """Graphs hold cache addresses: another cache object drops them all (and the pool)."""
        if (tcache is not None and tcache is not self._tcache and self._tcache is not None) or \
                (dcache is not None and dcache is not self._dcache and self._dcache is not None):
            self.reset()
        self._tcache = tcache if tcache is not None else self._tcache
        self._dcache = dcache if dcache is not None else self._dcache

    def reset(self):
        """Drops every captured graph; the next calls capture again into a fresh pool."""
        self._verify.clear()
        self._draft.clear()
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()

    def _run(self, bucket: _Bucket):
        """Eager padded run, or replay (capturing on first use) of the bucket's graph."""
        if not self.capture:
            return bucket.fn()
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        return bucket.out

    def _capture(self, bucket: _Bucket):
        """Warm-up runs on a side stream (cuBLAS workspaces, kernel attributes, the scratch
        pool: nothing may allocate with cudaMalloc during capture), then the capture into the
        shared pool. The buffers hold a real or an all-padding batch: the warm-ups write the
        K/V the replay writes again (the computation is idempotent) or nothing."""
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(self.warmup):
                    bucket.fn()
            cur.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
                out = bucket.fn()
            bucket.graph, bucket.out = graph, out
            self.stats["captures"] += 1

    def capture_all(self, tcache, dcache=None):
        """Captures every bucket now, over all-padding batches (nothing is written to the
        caches), largest first so that smaller graphs reuse the pool's blocks."""
        if not self.capture:
            return
        empty = AttnMeta(torch.zeros(1, dtype=torch.int32, device=self.device),
                         torch.zeros(0, dtype=torch.int32, device=self.device),
                         torch.zeros(0, 1, dtype=torch.int32, device=self.device),
                         torch.zeros(0, dtype=torch.int64, device=self.device), True)
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._bind(tcache=tcache, dcache=dcache)
        if self.drafter is not None and dcache is not None and self.draft_capturable:
            rng = {k: v[:0] for k, v in self.rng.items()}
            for r_b in reversed(self.draft_buckets):
                if self._draft_bucket(r_b).graph is None:
                    self._load_draft(r_b, none, none, empty, rng)
                    self._capture(self._draft_bucket(r_b))
        for n_b in reversed(self.verify_buckets):
            if self._verify_bucket(n_b).graph is None:
                self.vbuf.load(n_b, min(n_b, self.vbuf.max_batch), none, empty, ids=none)
                self._capture(self._verify_bucket(n_b))

    def graphs(self):
        """Every captured graph (tests check they share self.pool)."""
        return [b.graph for b in (*self._verify.values(), *self._draft.values()) if b.graph]

    # -- verify ------------------------------------------------------------------------------

    def _verify_bucket(self, n_b: int) -> _Bucket:
        if n_b not in self._verify:
            ids, pos, meta = self.vbuf.view(n_b, min(n_b, self.vbuf.max_batch), True)
            cache = self._tcache

            def fn():
                """(logits [n_b, V], features [n_b, m * d] or None) of the padded batch."""
                return self.target.forward(ids, pos, meta, cache, capture_layers=self.capture_layers,
                                           logits_dtype=self.verify_dtype)

            self._verify[n_b] = _Bucket(fn)
        return self._verify[n_b]

    def verify(self, ids, positions, meta: AttnMeta, cache):
        """target.forward(ids, positions, meta, cache, capture_layers) for a verify batch: ids,
        positions [N] int64 on the device, meta causal. Returns (logits [N, V] in verify_dtype,
        features [N, m * d] or None), bucketed when N, R and the block-table
        width fit, eager otherwise."""
        n, r, w = ids.shape[0], meta.kv_lens.shape[0], meta.block_tables.shape[1]
        n_b = self._pick(self.verify_buckets, n)
        if n_b is None or r > min(n_b, self.vbuf.max_batch) or w > self.vbuf.max_pages \
                or not meta.causal:
            self.stats["verify_eager"] += 1
            return self.target.forward(ids, positions, meta, cache,
                                       capture_layers=self.capture_layers,
                                       logits_dtype=self.verify_dtype)
        self._bind(tcache=cache)
        self.vbuf.load(n_b, min(n_b, self.vbuf.max_batch), positions, meta, ids=ids)
        logits, feats = self._run(self._verify_bucket(n_b))
        self.stats["verify_padded"] += 1
        return logits[:n], (feats[:n] if feats is not None else None)

    # -- draft -------------------------------------------------------------------------------

    def _draft_bucket(self, r_b: int) -> _Bucket:
        if r_b not in self._draft:
            _, pos, meta = self.dbuf.view(r_b * self.block_size, r_b, False)
            anchor, rng = self.anchor[:r_b], {k: v[:r_b] for k, v in self.rng.items()}
            out = (self.tokens_out[:r_b], self.z_out[:r_b], self.lse_out[:r_b], self.conf_out[:r_b])
            cache = self._dcache

            def fn():
                """Writes tokens_out, z_out, lse_out, conf_out [:r_b]; padding requests are
                those with kv_len 0 (a real block has kv_len >= block_size)."""
                return draft_forward(self.target, self.drafter, self.head, self.head_weights,
                                     self.logits_dtype, self.head_dtype, anchor, pos, meta,
                                     cache, rng,
                                     live=meta.kv_lens > 0, out=out)

            self._draft[r_b] = _Bucket(fn)
        return self._draft[r_b]

    def _load_draft(self, r_b, anchor, positions, meta, rng):
        R = anchor.shape[0]
        self.dbuf.load(r_b * self.block_size, r_b, positions, meta)
        self.anchor[:R].copy_(anchor)
        self.anchor[R:r_b].zero_()
        for k, buf in self.rng.items():
            buf[:R].copy_(rng[k])
            buf[R:r_b].zero_()  # temperature 0: padding requests draft greedily, uncoupled

    def draft(self, anchor, positions, meta: AttnMeta, cache, rng: dict):
        """Runner.draft after its metadata: anchor [R] int64; positions [R * block_size] int64
        and meta (bidirectional) of each request's block; rng: temperature [R] float32, seed,
        stream, round_ [R] int64, coupled [R] uint8 (Runner.rng). Returns (tokens [R, gamma]
        int64, z [R, gamma, V], lse [R, gamma], conf_logit [R, gamma]), bucketed by R, eager
        when R or the block-table width do not fit (and for the rnn head)."""
        if self.drafter is None:
            raise ValueError("GraphRunner.draft: built without a drafter")
        R, w = anchor.shape[0], meta.block_tables.shape[1]
        r_b = self._pick(self.draft_buckets, R)
        if r_b is None or w > self.dbuf.max_pages or meta.causal or not self.draft_capturable:
            self.stats["draft_eager"] += 1
            return draft_forward(self.target, self.drafter, self.head, self.head_weights,
                                 self.logits_dtype, self.head_dtype, anchor, positions, meta,
                                 cache, rng)
        self._bind(dcache=cache)
        self._load_draft(r_b, anchor, positions, meta, rng)
        tokens, z, lse, conf = self._run(self._draft_bucket(r_b))
        self.stats["draft_padded"] += 1
        return tokens[:R], z[:R], lse[:R], conf[:R]
