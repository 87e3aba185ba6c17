"""The worker: model pair, paged KV caches and the forwards of a round, over batches the engine
packs (SeqBatch). It computes and returns; it writes no request state. The round that drives it
is runner/round.py.

Modes: "ar" verifies only the anchor (plain decoding), "dflash" drafts with the backbone alone
and verifies every draft, "dspark" adds the sequential head and the confidence head.
"""
import numbers
import os
from dataclasses import dataclass

import numpy as np
import torch

from .. import ops
from ..models.batch import AttnMeta
from ..batch import SeqBatch, pages_for
from .forward import draft_forward
from .logits_process import filter_rows, mask_rows

MODES = ("ar", "dflash", "dspark")


def _tables(page_lists) -> np.ndarray:
    """Block tables [R, max(1, longest)] int64 on the host, zero-padded."""
    width = max(1, max(len(p) for p in page_lists))
    return np.array([list(p) + [0] * (width - len(p)) for p in page_lists], dtype=np.int64)


def _chains(tables: np.ndarray, starts, counts, page_size: int):
    """Rows of chains of counts[r] positions from starts[r] in a flat batch: (request of each
    row, its offset in the chain, positions, KV slots), int64 host arrays. numpy, not torch:
    these are a few dozen host integers per request, where a torch call costs more than its work."""
    counts = np.asarray(counts, dtype=np.int64)
    req = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.asarray(starts, dtype=np.int64)[req] + offset
    slots = tables[req, positions // page_size] * page_size + positions % page_size
    return req, offset, positions, slots


def prefill_rows(counts, every_row=None) -> tuple[list[int], list[int]]:
    """Where Runner.prefill puts each chunk's logits rows: (first row of each chunk, its last
    row). A chunk of counts[i] positions has counts[i] rows with every_row[i], else one."""
    first, last, o = [], [], 0
    for i, n in enumerate(counts):
        k = n if every_row is not None and every_row[i] else 1
        first.append(o)
        o += k
        last.append(o - 1)
    return first, last


@dataclass
class Draft:
    """Steps 1-3 of a round: drafts x_1..x_gamma [R, gamma] int64, the corrected draft logits z
    [R, gamma, V] and their lse [R, gamma] (the proposal q), raw confidence logits [R, gamma]
    (None without a confidence head) and the anchors x_0 [R] (all on the device)."""
    tokens: torch.Tensor
    z: torch.Tensor
    lse: torch.Tensor
    conf_logit: torch.Tensor | None
    anchor: torch.Tensor

    def spread(self, rows: list[int], anchor: torch.Tensor) -> "Draft":
        """This draft of a subset of requests placed at rows of a batch with these anchors [R];
        the other rows get token 0, z 0, lse 0 and confidence logit 0 (they verify no drafts,
        so nothing reads them)."""
        idx = torch.tensor(rows, dtype=torch.int64).to(anchor.device, non_blocking=True)

        def put(t):
            if t is None:
                return None
            out = torch.zeros((anchor.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            return out.index_copy_(0, idx, t)
        return Draft(put(self.tokens), put(self.z), put(self.lse), put(self.conf_logit), anchor)


@dataclass(frozen=True, eq=False)
class CacheLease:
    """Who owns a runner's caches: the holder of the current lease (compared by identity)."""
    num_pages: int


class Runner:
    use_graphs = True  # a subclass whose forwards cannot be captured turns the graphs off
    # the round state may keep target features between rounds (deferred drafter context,
    # state.py); off where the round runs on other processes too (parallel.ParallelRunner)
    defers_context = True

    def __init__(self, target, drafter, mode: str, page_size: int, device):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "ar" and drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter checkpoint")
        if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        page_size = int(page_size)
        self.target, self.drafter, self.mode = target, (drafter if mode != "ar" else None), mode
        self.page_size, self.device = page_size, torch.device(device)
        self.max_len = target.config.max_position_embeddings
        self.gamma = drafter.gamma if mode != "ar" else 0
        self.block_size = drafter.block_size if mode != "ar" else 0
        self.capture = list(drafter.target_layer_ids) if mode != "ar" else None
        self.logits_dtype = torch.float64 if target.dtype == torch.float64 else torch.float32
        # the verify forward's logits: a 16-bit model's product as it is where the acceptance
        # kernel widens it on load (no cast pass: half the bytes written and read), else widened
        self.verify_dtype = self.logits_dtype
        if target.dtype in (torch.bfloat16, torch.float16) and \
                ops.takes_narrow_target(self.device, target.dtype):
            self.verify_dtype = target.dtype
        self.head = drafter.head if mode == "dspark" else "none"
        # the dtype of the head's weights and of the hidden states it reads (DESIGN §2 step 2)
        self.head_dtype = self.logits_dtype
        if mode != "ar" and (drafter.dtype != torch.float16 or self.device.type == "cuda"):
            self.head_dtype = drafter.dtype
        self.has_confidence = mode == "dspark" and drafter.conf_w is not None
        self.head_weights = self._head_weights()
        self.tcache = self.dcache = None
        self.lease: CacheLease | None = None
        # Device-to-host reads, all through to_host: a decode round costs one (the emitted
        # tokens), two when a host-side policy reads confidences.
        self.host_reads = 0
        # CUDA graphs per bucket of the verify and draft forwards (runner/graphs.py); on the CPU,
        # or with DSPARK_CUDA_GRAPHS=0, every forward runs eagerly.
        self.graphs = None
        if self.use_graphs and self.device.type == "cuda" and \
                os.environ.get("DSPARK_CUDA_GRAPHS", "1") != "0":
            from .graphs import GraphRunner, capture_problem
            if capture_problem(target) is None:
                self.graphs = GraphRunner.from_runner(self)

    def _head_weights(self) -> dict:
        """The sequential and confidence head tensors ops.markov_sample takes, as the drafter
        holds them: a bf16 model serves bf16 weights (the kernels' 16-bit path; logits stay
        float32). fp16 on the CPU is widened to the logits dtype (the C++ kernel has no fp16
        weights)."""
        if self.mode != "dspark":
            return {}
        d = self.drafter
        names = ("w1", "w2", "gate_w", "gate_b", "joint_w", "joint_b", "conf_w", "conf_b")
        out = {n: None if getattr(d, n) is None else getattr(d, n).to(self.head_dtype).contiguous()
               for n in names}
        if self.head == "selector":  # DFlash2: candidates per step
            out["top_k"] = d.top_k
        return out

    def lease_caches(self, num_pages: int) -> "CacheLease":
        """New caches of num_pages pages each, and the lease on them: its holder (an Engine) owns
        them until the next lease (runner.lease is the current one)."""
        self.lease = None
        self.allocate_caches(num_pages)
        self.lease = CacheLease(num_pages)
        return self.lease

    def allocate_caches(self, num_pages: int):
        """Target and drafter caches of num_pages pages each (the engine's block managers hand
        the pages out). A failure leaves the runner without caches (never with one of two), and the next call starts afresh."""
        self.tcache = self.dcache = None  # the old pool goes before the new one is allocated
        tcache = self.target.make_cache(num_pages, self.page_size)
        dcache = self.drafter.make_cache(num_pages, self.page_size) if self.drafter is not None else None
        self.tcache, self.dcache = tcache, dcache

    def run_round(self, round_, batch: SeqBatch, decision, policy, calibration, state):
        """round_(self, batch, decision, policy, calibration, state): the engine runs its Round
        through here, so a runner that drives other processes (parallel.ParallelRunner) starts
        it on them too."""
        return round_(self, batch, decision, policy, calibration, state)

    def decided(self, fn, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like `like` that the policy computes (fn()): in one process,
        fn(); under tensor parallelism the leader's, on every rank (ParallelRunner)."""
        return fn()

    # -- host <-> device ---------------------------------------------------------------------

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The one device-to-host read of the runtime (a synchronisation on a GPU), counted."""
        self.host_reads += 1
        return t.cpu()

    def upload(self, data, dtype) -> torch.Tensor:
        """Host data -> device without waiting for the device (H2D copies never synchronise)."""
        t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        return t.to(self.device, dtype, non_blocking=True)

    def _check_pages(self, pages: list[int], n_tokens: int, which: str):
        if pages_for(n_tokens, self.page_size) > len(pages):
            raise RuntimeError(f"runner: {n_tokens} positions need "
                               f"{pages_for(n_tokens, self.page_size)} {which} pages, the "
                               f"scheduler reserved {len(pages)}")

    def meta(self, page_lists, starts, counts, causal):
        """AttnMeta for chains of counts[r] new tokens at positions starts[r].. of each request,
        built on the host and uploaded in one copy. Returns (meta, positions [N] on the device,
        cu [R + 1] on the host)."""
        R = len(counts)
        for pages, s, n in zip(page_lists, starts, counts):
            self._check_pages(pages, s + n, "KV")
        tables = _tables(page_lists)
        width = tables.shape[1]
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        N = cu[-1]
        _, _, positions, slots = _chains(tables, starts, counts, self.page_size)
        ends = [s + n for s, n in zip(starts, counts)]
        host = np.concatenate([np.asarray(cu + ends, dtype=np.int64), tables.ravel(), slots, positions])
        dev = self.upload(torch.from_numpy(host), torch.int64)
        o = R + 1
        cu_q, kv_lens = dev[:o].int(), dev[o : o + R].int()
        o += R
        block_tables = dev[o : o + R * width].view(R, width).int()
        o += R * width
        meta = AttnMeta(cu_q, kv_lens, block_tables, dev[o : o + N], causal)
        return meta, dev[o + N :], cu

    def meta_on_device(self, batch: SeqBatch, lengths: torch.Tensor, n_rows: int,
                       chains: torch.Tensor):
        """Verify metadata when the lengths [R] (int64) stay on the device: request r verifies
        chains[r, :lengths[r] + 1] ([R, gamma + 1]: anchor then drafts) at positions kv_len.. .
        n_rows >= R + sum(lengths) is known on the host; rows past the real total are padding
        (id 0, position 0, slot -1). Returns (meta, positions, ids)."""
        R, ps, g1 = len(batch), self.page_size, chains.shape[1]
        for pages, kv, c in zip(batch.target_pages, batch.kv_lens, batch.caps):
            self._check_pages(pages, kv + min(c, self.gamma) + 1, "target")
        tables = _tables(batch.target_pages)
        width = tables.shape[1]
        dev = self.upload(torch.from_numpy(np.concatenate([np.asarray(batch.kv_lens, dtype=np.int64),
                                                           tables.ravel()])), torch.int64)
        kv0, tables = dev[:R], dev[R:].view(R, width)
        counts = lengths + 1
        cu = torch.zeros(R + 1, dtype=torch.int64, device=lengths.device)
        cu[1:] = torch.cumsum(counts, 0)
        row = torch.arange(n_rows, device=lengths.device)
        req = torch.searchsorted(cu[1:], row, right=True)  # R for padding rows
        valid = req < R
        req_c = req.clamp(max=R - 1)
        k = row - cu[req_c]
        pos = torch.where(valid, kv0[req_c] + k, 0)
        page = tables[req_c, (pos // ps).clamp(max=width - 1)]
        slots = torch.where(valid, page * ps + pos % ps, -1)
        ids = torch.where(valid, chains.reshape(-1)[req_c * g1 + k.clamp(0, g1 - 1)], 0)
        meta = AttnMeta(cu.int(), (kv0 + counts).int(), tables.int(), slots, True)
        return meta, pos, ids

    def rng(self, batch: SeqBatch) -> dict:
        """The ops' random keys (temperature, seed, stream, round_, coupled), in one upload."""
        seeds = [s - (1 << 64) if s >= (1 << 63) else s for s in batch.seeds]
        sp = batch.sampling
        coupled = [int(c) for c in sp.coupled]
        ints = self.upload([seeds, batch.streams, batch.rounds, coupled], torch.int64)
        return dict(temperature=self.upload(sp.temperature, torch.float32),
                    seed=ints[0], stream=ints[1], round_=ints[2], coupled=ints[3].to(torch.uint8))

    # -- forwards ----------------------------------------------------------------------------

    def prefill(self, batch: SeqBatch, starts, ends, tokens, shared=None,
                every_row=None) -> torch.Tensor:
        """Runs tokens[i] at positions starts[i] .. ends[i]-1 of each request through the target
        and, with a drafter, their features into its context (positions starts[i].. as well).
        Returns the logits of each chunk's last position [R, V]; with every_row[i] True, those
        of every position of chunk i instead (rows in chunk order: prefill_rows gives where
        each chunk's rows start and its last row). shared[i]: how many leading positions of
        chunk i already sit in prefix-cached target pages: they are recomputed only for their
        features, and their K/V is not written (slot -1), since other requests may be reading
        those pages."""
        counts = [e - s for s, e in zip(starts, ends)]
        meta, pos, cu = self.meta(batch.target_pages, starts, counts, True)
        for i, n in enumerate(shared or []):
            if n:
                meta.slot_mapping[cu[i] : cu[i] + n] = -1
        ids = self.upload([t for chunk in tokens for t in chunk], torch.int64)
        rows = [c - 1 for c in cu[1:]]
        if every_row is not None and any(every_row):
            rows = [r for i in range(len(counts))
                    for r in (range(cu[i], cu[i + 1]) if every_row[i] else (cu[i + 1] - 1,))]
        logits, feats = self.target.forward(ids, pos, meta, self.tcache, capture_layers=self.capture,
                                            logits_rows=self.upload(rows, torch.int64))
        if self.drafter is not None:
            self.context_update(batch.drafter_pages, starts, counts, feats, cu[:-1])
        return logits.to(self.logits_dtype)

    def draft(self, batch: SeqBatch, rng: dict) -> Draft:
        """Steps 1-3: the block [x0, m, .., m] through the drafter (its K/V in scratch slots right
        after the context, overwritten by the context update later), the LM head, the
        sequential head and the confidence head; one CUDA graph per batch bucket on CUDA."""
        R = len(batch)
        meta, pos, _ = self.meta(batch.drafter_pages, batch.ctx_lens, [self.block_size] * R, False)
        anchor = self.upload(batch.anchors, torch.int64)
        if self.graphs is not None:
            tokens, z, lse, conf = self.graphs.draft(anchor, pos, meta, self.dcache, rng)
        else:
            tokens, z, lse, conf = draft_forward(self.target, self.drafter, self.head,
                                                 self.head_weights, self.logits_dtype,
                                                 self.head_dtype, anchor, pos, meta, self.dcache,
                                                 rng)
        return Draft(tokens, z, lse, conf if self.has_confidence else None, anchor)

    def verify(self, ids, pos, meta: AttnMeta):
        """Step 5: the target's causal forward over the flat verify batch. Returns (logits [N, V]
        in verify_dtype, features [N, m * d] or None)."""
        if self.graphs is not None:
            return self.graphs.verify(ids, pos, meta, self.tcache)
        return self.target.forward(ids, pos, meta, self.tcache, capture_layers=self.capture,
                                   logits_dtype=self.verify_dtype)

    def context_update(self, page_lists, starts, counts, feats, row_starts):
        """Projects the target features of committed positions starts[r] .. +counts[r] (rows
        row_starts[r] .. of feats) into the drafter's context cache (DESIGN §2 step 7)."""
        if self.drafter is None or not counts:
            return
        for pages, s, n in zip(page_lists, starts, counts):
            self._check_pages(pages, s + n, "KV")
        req, offset, positions, slots = _chains(_tables(page_lists), starts, counts, self.page_size)
        rows = np.asarray(row_starts, dtype=np.int64)[req] + offset
        dev = self.upload(torch.from_numpy(np.stack([positions, slots])), torch.int64)
        if len(rows) != feats.shape[0] or (rows != np.arange(len(rows))).any():
            feats = feats[self.upload(torch.from_numpy(rows), torch.int64)]
        self.drafter.context_update(feats, dev[0], dev[1], self.dcache)

    # -- sampling helpers --------------------------------------------------------------------

    def filter(self, batch: SeqBatch, logits, cu_rows: list[int], ids: torch.Tensor | None = None):
        """Applies each request's logits processors to its rows of target logits, in place:
        the masks (allowed ids, bad words, min_tokens), then min-p / top-k / top-p when sampled.
        ids [N]: the verify chains [x0, x_1 .. x_l] of the rows (bad words read row k's context
        through the drafts before it); None: one row per request. The nucleus is that of the
        rows widened to logits_dtype (16-bit verify logits stay 16-bit: the entries it keeps are
        untouched, the others -inf, as in the widened rows)."""
        sp = batch.sampling
        for i, on in enumerate(sp.filtered):
            if not on:
                continue
            lo, hi = cu_rows[i], cu_rows[i + 1]
            rows = logits[lo:hi]
            mask_rows(rows, sp.allowed[i], sp.bad_words[i], sp.recent[i],
                      None if ids is None else ids[lo + 1 : hi], sp.min_tokens[i], sp.emitted[i],
                      sp.min_stop[i])
            T = sp.temperature[i]
            if T > 0 and (sp.top_k[i] > 0 or sp.top_p[i] < 1.0 or sp.min_p[i] > 0):
                kept = filter_rows(rows.to(self.logits_dtype) / T, sp.top_k[i], sp.top_p[i], sp.min_p[i])
                logits[lo:hi] = rows.masked_fill(torch.isinf(kept) & ~torch.isinf(rows), float("-inf"))
        return logits

    def read_results(self, acc, out, failed, extra=()):
        """One host copy of what the host needs from a round: accepted counts, emitted tokens,
        whether a request's logits hold NaN or +inf (failed [R], from rejection_sample's row pass:
        that request fails alone), and `extra` per-request device tensors. Returns (accepted,
        tokens, failed, extra columns [R, k] or None)."""
        R, g1 = acc.shape[0], out.shape[1]
        cols = [acc.long()[:, None], failed.long()[:, None], out] + [e.reshape(R, -1) for e in extra]
        if extra:  # one float64 copy: ids and lengths are exact in it, survivals are float32
            host = self.to_host(torch.cat([c.double() for c in cols], 1))
        else:
            host = self.to_host(torch.cat(cols, 1))
        ints = host[:, : 2 + g1].long().tolist()
        acc_h = [row[0] for row in ints]
        toks = [row[2 : 3 + a] for row, a in zip(ints, acc_h)]
        return acc_h, toks, [row[1] > 0 for row in ints], (host[:, 2 + g1 :] if extra else None)
