"""One DSpark round for a batch of requests (DESIGN §2), and the prefill that starts them.

Modes share this code: "ar" verifies only the anchor (plain decoding), "dflash" drafts with the
backbone alone and verifies every draft, "dspark" adds the sequential head, the confidence head
and a verify-length policy.
"""
import os
import time
from dataclasses import dataclass

import torch

from . import ops
from .kv_cache import PageAllocator, PagedKVCache
from .logits_process import filter_rows
from .models.batch import AttnMeta
from .policy import Calibration, FixedPolicy, VerifyPolicy
from .request import Request
from .schedulers import candidates

MODES = ("ar", "dflash", "dspark")


def _tables(page_lists) -> torch.Tensor:
    """Block tables [R, max(1, longest)] int64 on the host, zero-padded."""
    tables = torch.zeros(len(page_lists), max(1, max(len(p) for p in page_lists)), dtype=torch.int64)
    for i, pages in enumerate(page_lists):
        tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
    return tables


def _filters(p) -> bool:
    """Whether a request's target rows go through top-k / top-p filtering."""
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0)


def _raw_copy(reqs, logits: torch.Tensor) -> torch.Tensor:
    """The logits as the model gave them when a request wants logprobs and filtering will change
    them in place (logprobs are the target's raw log-probabilities); else the same tensor."""
    if any(r.params.logprobs and _filters(r.params) for r in reqs):
        return logits.clone()
    return logits


@dataclass
class RoundResult:
    """What one round produced. The per-request results come to the host in one copy; logits and
    features stay on the device (logprobs and the drafter context update read them there)."""
    num_accepted: list[int]     # per request
    out_tokens: list[list[int]]  # per request: x_1 .. x_a, y (emitted tokens)
    failed: list[bool]          # NaN or +inf in one of the request's target rows
    lengths: list[int]          # verified drafts per request
    logits: torch.Tensor        # [N, V] target logits of the verify forward, before top-k/top-p
                                # filtering (device; logprobs read them)
    cu_rows: list[int]          # [R + 1] rows of each request in logits / features
    features: torch.Tensor | None  # [N, m * d] target features for the drafter context
    conf_logit: torch.Tensor | None  # [R, gamma] raw confidence logits (dspark with a head)


class Runner:
    def __init__(self, target, drafter, mode: str, policy: VerifyPolicy,
                 calibration: Calibration | None, page_size: int, device: torch.device):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "ar" and drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter checkpoint")
        if mode == "dspark" and policy.needs_confidence and drafter.conf_w is None:
            raise ValueError(f"policy {policy.name!r} needs a confidence head, which this drafter lacks")
        self.target, self.drafter, self.mode, self.policy = target, drafter, mode, policy
        self.page_size, self.device = page_size, device
        self.max_len = target.config.max_position_embeddings
        self.gamma = drafter.gamma if mode != "ar" else 0
        self.calibration = calibration or Calibration.identity(max(self.gamma, 1))
        self.capture = list(drafter.target_layer_ids) if mode != "ar" else None
        self.logits_dtype = torch.float64 if target.dtype == torch.float64 else torch.float32
        self.head = drafter.head if mode == "dspark" else "none"
        self._head_weights = self._cast_head_weights() if mode != "ar" else {}
        self.tcache = self.dcache = None
        self.talloc = self.dalloc = None
        # Set to a dict to accumulate seconds per round phase (benchmarks); costs one device
        # sync per phase when set, nothing when None.
        self.phase_times: dict[str, float] | None = None
        # Device-to-host reads, all through to_host: a decode round costs one (the emitted
        # tokens), two when the policy reads confidences; benchmarks report the count.
        self.host_reads = 0
        self.rounds = self.round_host_reads = 0  # rounds run, and host reads inside them
        # Benchmark-only acceptance override (dspark_rt.synthetic.install); None when serving.
        self.synthetic = None
        # CUDA graphs per bucket of the verify and draft forwards (dspark_rt/graphs.py); on the
        # CPU, or with DSPARK_CUDA_GRAPHS=0, every forward runs eagerly.
        self.graphs = None
        if device.type == "cuda" and os.environ.get("DSPARK_CUDA_GRAPHS", "1") != "0":
            from .graphs import GraphRunner, capture_problem
            if capture_problem(target) is None:
                self.graphs = GraphRunner.from_runner(self)

    # -- caches ------------------------------------------------------------------------------

    def _cast_head_weights(self):
        """Head tensors in the logits dtype (the CPU kernels take one float type)."""
        d, dt = self.drafter, self.logits_dtype
        cast = lambda t: None if t is None else t.to(dt).contiguous()
        w = {"w1": cast(d.w1), "w2": cast(d.w2)}
        if self.mode == "dspark":
            w.update(gate_w=cast(d.gate_w), gate_b=cast(d.gate_b), joint_w=cast(d.joint_w),
                     joint_b=cast(d.joint_b), conf_w=cast(d.conf_w), conf_b=cast(d.conf_b))
        elif self.head == "none":
            w = {}
        return w

    def reserve(self, requests: list[Request]):
        """Sizes the paged caches for these requests' whole lifetimes (offline batches)."""
        ps = self.page_size
        slack = self.gamma + (self.drafter.block_size if self.drafter is not None else 0) + 2
        need = sum(-(-(len(r.prompt_ids) + r.params.max_tokens + slack) // ps) for r in requests)
        t = self.target
        if self.tcache is None or self.talloc is None or self.tcache.num_pages < need:
            self.tcache = PagedKVCache(t.config.num_hidden_layers, need, ps,
                                       t.config.num_key_value_heads, t.config.head_dim,
                                       t.dtype, self.device)
            self.talloc = PageAllocator(need)
            if self.mode != "ar":
                dc = self.drafter.config
                self.dcache = PagedKVCache(dc.num_hidden_layers, need, ps, dc.num_key_value_heads,
                                           dc.head_dim, t.dtype, self.device)
                self.dalloc = PageAllocator(need)

    def allocate_caches(self, num_pages: int):
        """Caches of num_pages pages whose pages an engine's block managers hand out."""
        t = self.target
        self.tcache = PagedKVCache(t.config.num_hidden_layers, num_pages, self.page_size,
                                   t.config.num_key_value_heads, t.config.head_dim, t.dtype, self.device)
        self.dcache = None
        if self.mode != "ar":
            dc = self.drafter.config
            self.dcache = PagedKVCache(dc.num_hidden_layers, num_pages, self.page_size,
                                       dc.num_key_value_heads, dc.head_dim, t.dtype, self.device)
        self.talloc = self.dalloc = None

    def release(self, req: Request):
        if req.target_pages:
            self.talloc.free(req.target_pages)
            req.target_pages = []
        if req.drafter_pages:
            self.dalloc.free(req.drafter_pages)
            req.drafter_pages = []

    def _grow(self, pages: list[int], alloc: PageAllocator | None, n_tokens: int):
        missing = -(-n_tokens // self.page_size) - len(pages)
        if missing > 0:
            if alloc is None:  # an engine's scheduler owns the pages and reserved too few
                raise RuntimeError(f"runner: {n_tokens} tokens need {missing} more pages than "
                                   "the request scheduler reserved")
            pages.extend(alloc.allocate(missing))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The one device-to-host read of the runtime (a synchronisation on a GPU): the runner's
        own, and the Decoder's (logprobs, the round log), all counted in host_reads."""
        self.host_reads += 1
        return t.cpu()

    def _upload(self, data, dtype) -> torch.Tensor:
        """Host data -> device without waiting for the device (H2D copies never synchronise)."""
        t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        return t.to(self.device, dtype, non_blocking=True)

    def _meta(self, page_lists, starts, counts, causal):
        """AttnMeta for chains of counts[r] new tokens at positions starts[r].. of each request,
        built on the host and uploaded in one copy. Returns (meta, positions [N] on the device,
        cu [R + 1] on the host)."""
        ps, R = self.page_size, len(counts)
        tables = _tables(page_lists)
        width = tables.shape[1]
        slots, positions = [], []
        for i, (s, n) in enumerate(zip(starts, counts)):
            pos = torch.arange(s, s + n)
            slots.append(tables[i][pos // ps] * ps + pos % ps)
            positions.append(pos)
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        N = cu[-1]
        host = torch.cat([torch.tensor(cu), torch.tensor([s + n for s, n in zip(starts, counts)]),
                          tables.view(-1), torch.cat(slots), torch.cat(positions)])
        dev = self._upload(host, torch.int64)
        o = R + 1
        cu_q, kv_lens = dev[:o].int(), dev[o : o + R].int()
        o += R
        block_tables = dev[o : o + R * width].view(R, width).int()
        o += R * width
        meta = AttnMeta(cu_q, kv_lens, block_tables, dev[o : o + N], causal)
        return meta, dev[o + N :], cu

    # -- prefill -----------------------------------------------------------------------------

    def prefill(self, reqs: list[Request]) -> torch.Tensor:
        """Runs whole prompts (offline batches). Returns the last position's logits [R, V]."""
        return self.prefill_chunks(reqs, [0] * len(reqs), [len(r.prompt_ids) for r in reqs],
                                   [r.prompt_ids for r in reqs])

    def prefill_chunks(self, reqs, starts, ends, tokens, shared=None) -> torch.Tensor:
        """Runs tokens[i] at positions starts[i] .. ends[i]-1 of each request through the target
        (and their features into the drafter's context). Returns the logits of each chunk's last
        position [R, V]. shared[i]: how many leading positions of chunk i already sit in
        prefix-cached target pages: they are recomputed only for their features, and their K/V
        is not written (slot -1), since other requests may be reading those pages."""
        counts = [e - s for s, e in zip(starts, ends)]
        for r, e in zip(reqs, ends):
            self._grow(r.target_pages, self.talloc, e)
        meta, pos, cu = self._meta([r.target_pages for r in reqs], starts, counts, True)
        for i, n in enumerate(shared or []):
            if n:
                meta.slot_mapping[cu[i] : cu[i] + n] = -1
        ids = self._upload([t for chunk in tokens for t in chunk], torch.int64)
        last = self._upload([c - 1 for c in cu[1:]], torch.int64)
        logits, feats = self.target.forward(ids, pos, meta, self.tcache, capture_layers=self.capture,
                                            logits_rows=last)
        for r, e in zip(reqs, ends):
            r.kv_len = max(r.kv_len, e)
        if self.mode != "ar":
            self._context_update(reqs, starts, counts, feats, cu[:-1])
        return logits.to(self.logits_dtype)

    def _context_update(self, reqs, starts, counts, feats, row_starts):
        """Projects the target features of committed positions starts[r] .. +counts[r] (rows
        row_starts[r] .. of feats) into the drafter's context cache (DESIGN §2 step 7)."""
        rows = self._upload(torch.cat([torch.arange(s, s + n) for s, n in zip(row_starts, counts)]),
                            torch.int64)
        for r, s, n in zip(reqs, starts, counts):
            self._grow(r.drafter_pages, self.dalloc, s + n)
        meta, pos, _ = self._meta([r.drafter_pages for r in reqs], starts, counts, False)
        self.drafter.context_update(feats[rows], pos, meta.slot_mapping, self.dcache)
        for r, s, n in zip(reqs, starts, counts):
            r.ctx_len = s + n

    # -- one round ---------------------------------------------------------------------------

    def _phase_start(self) -> float:
        if self.phase_times is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _phase(self, name: str, t0: float) -> float:
        """Adds the time since t0 to phase `name` (when timing is on); returns the new t0."""
        if self.phase_times is None:
            return t0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phase_times[name] = self.phase_times.get(name, 0.0) + now - t0
        return now

    def draft(self, reqs: list[Request], rng: dict | None = None):
        """Parallel drafting then the sequential head. rng: _rng(reqs), when the caller has it.
        Returns (tokens [R, gamma], z [R, gamma, V], lse [R, gamma], conf_logit [R, gamma],
        anchor [R])."""
        rng = rng if rng is not None else self._rng(reqs)
        d, B, gamma = self.drafter, self.drafter.block_size, self.gamma
        R = len(reqs)
        for r in reqs:
            self._grow(r.drafter_pages, self.dalloc, r.ctx_len + B)
        # The block's K/V go to scratch slots right after the context; the context update of
        # committed positions overwrites them later.
        meta, pos, _ = self._meta([r.drafter_pages for r in reqs], [r.ctx_len for r in reqs], [B] * R, False)
        anchor = self._upload([r.anchor for r in reqs], torch.int64)
        if self.graphs is not None:  # forward, LM head and sequential head replay as one graph
            t0 = self._phase_start()
            tokens, U, lse, conf = self.graphs.draft(anchor, pos, meta, self.dcache, rng)
            self._phase("draft_forward", t0)
            return tokens, U, lse, conf, anchor
        ids = torch.full((R, B), d.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = anchor
        t0 = self._phase_start()
        hidden = d.forward_block(ids.view(-1), pos, meta, self.dcache).view(R, B, -1)
        h = hidden[:, :gamma] if d.layout == "anchor_first" else hidden[:, 1:]
        h = h.contiguous()
        U = self.target.lm_head(h.reshape(R * gamma, -1)).to(self.logits_dtype).view(R, gamma, -1)
        t0 = self._phase("draft_forward", t0)
        tokens, _, lse, conf = ops.markov_sample(
            U, h.to(self.logits_dtype), anchor, self.head, **self._head_weights, **rng)
        self._phase("sequential_head", t0)
        return tokens, U, lse, conf, anchor

    def _rng(self, reqs):
        """The ops' random keys. A coupled request keys its noise by output index (DESIGN §2):
        its round_ is n0, the number of tokens it emitted so far, and block position k draws
        the noise of output index n0 + k, so its tokens do not depend on where rounds split."""
        seeds = [r.seed - (1 << 64) if r.seed >= (1 << 63) else r.seed for r in reqs]
        rounds = [len(r.output_ids) if r.params.coupled else r.round for r in reqs]
        coupled = [int(r.params.coupled) for r in reqs]
        ints = self._upload([seeds, [r.stream for r in reqs], rounds, coupled], torch.int64)
        return dict(temperature=self._upload([r.params.temperature for r in reqs], torch.float32),
                    seed=ints[0], stream=ints[1], round_=ints[2], coupled=ints[3].to(torch.uint8))

    def _filter(self, reqs, logits, cu_rows: list[int]):
        """Applies each request's top-k / top-p to its rows of target logits."""
        for i, r in enumerate(reqs):
            p = r.params
            if not _filters(p):
                continue
            lo, hi = cu_rows[i], cu_rows[i + 1]
            rows = logits[lo:hi]
            kept = filter_rows(rows / p.temperature, p.top_k, p.top_p)
            logits[lo:hi] = rows.masked_fill(torch.isinf(kept) & ~torch.isinf(rows), float("-inf"))
        return logits

    def _results(self, acc, out, logits, cu: list[int] | None = None, owner=None, extra=()):
        """One host copy of what the host needs from a round: accepted counts, emitted tokens,
        whether a request's logits hold NaN or +inf (that request fails alone), and `extra`
        per-request device tensors. Rows belong to requests by cu (host) or owner ([N] device,
        -1 for padding rows). Returns (accepted, tokens, failed, extra columns [R, k] or None)."""
        R, g1 = acc.shape[0], out.shape[1]
        bad_rows = (torch.isnan(logits) | torch.isposinf(logits)).any(-1)
        if owner is None:
            owner = self._upload(torch.repeat_interleave(torch.arange(R), torch.tensor(cu).diff()),
                                 torch.int64)
        else:
            bad_rows = bad_rows & (owner >= 0)
            owner = owner.clamp(min=0)
        bad = torch.zeros(R, dtype=torch.int64, device=logits.device).index_add_(0, owner, bad_rows.long())
        cols = [acc.long()[:, None], bad[:, None], out] + [e.reshape(R, -1) for e in extra]
        if extra:  # one float64 copy: ids and lengths are exact in it, survivals are float32
            host = self.to_host(torch.cat([c.double() for c in cols], 1))
        else:
            host = self.to_host(torch.cat(cols, 1))
        ints = host[:, : 2 + g1].long().tolist()
        acc_h = [row[0] for row in ints]
        toks = [row[2 : 3 + a] for row, a in zip(ints, acc_h)]
        return acc_h, toks, [row[1] > 0 for row in ints], (host[:, 2 + g1 :] if extra else None)

    def _meta_on_device(self, reqs, lengths: torch.Tensor, n_rows: int, chains: torch.Tensor):
        """Verify metadata when the lengths [R] (int64) stay on the device: request r verifies
        chains[r, :lengths[r] + 1] ([R, gamma + 1]: anchor then drafts) at positions kv_len.. .
        n_rows >= R + sum(lengths) is known on the host; rows past the real total are padding
        (id 0, position 0, slot -1, owner -1). Returns (meta, positions, ids, owner)."""
        R, ps, g1 = len(reqs), self.page_size, chains.shape[1]
        tables = _tables([r.target_pages for r in reqs])
        width = tables.shape[1]
        dev = self._upload(torch.cat([torch.tensor([r.kv_len for r in reqs]), tables.view(-1)]),
                           torch.int64)
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
        return meta, pos, ids, torch.where(valid, req, -1)

    def sample_first(self, reqs: list[Request], logits: torch.Tensor):
        """The token after the prompt: a round with no drafts (round 0). Returns (target logits
        before filtering, emitted tokens per request, failed per request)."""
        R = len(reqs)
        cu = list(range(R + 1))
        raw = _raw_copy(reqs, logits)
        logits = self._filter(reqs, logits, cu)
        acc, out = ops.rejection_sample(logits, self._upload(cu, torch.int32), None, None, None,
                                        **self._rng(reqs))
        _, toks, failed, _ = self._results(acc, out, logits, cu)
        return raw, toks, failed

    def _admits_on_device(self, reqs) -> bool:
        """The policy admits drafts on the device (async) and no request filters its rows (the
        filter needs each request's rows on the host)."""
        return (self.mode == "dspark" and getattr(self.policy, "device_lengths", False)
                and not any(_filters(r.params) for r in reqs))

    def step(self, reqs: list[Request]) -> RoundResult:
        """One round for requests whose anchor is set. Device-to-host reads: the round's results
        at the end, plus the confidences before the verify forward when a host-side policy
        (threshold, sync) needs them; the async scheduler admits on the device instead."""
        R, gamma = len(reqs), self.gamma
        reads0 = self.host_reads
        rng = self._rng(reqs)  # one upload per round, read by the head and the acceptance
        on_device = None  # (lengths [R] on the device, survival, K, budget source, caps)
        if gamma:
            tokens, z, lse, conf, anchor = self.draft(reqs, rng)
            t0 = time.perf_counter()
            if self.synthetic is not None:
                conf = self.synthetic.conf_logit(R, gamma, conf if conf is not None else z)
            # The target's own token is emitted too, and the chain must stay inside the context.
            caps = [max(0, min(r.remaining - 1, self.max_len - 2 - r.kv_len)) for r in reqs]
            cap = torch.tensor(caps, dtype=torch.int64)
            chains = torch.cat([anchor[:, None], tokens], 1)  # [R, gamma + 1]
            if self._admits_on_device(reqs):
                _, survival = self.calibration.apply(conf)
                K, source = self.policy.next_budget(R, gamma)
                dev_lengths = self.policy.admit_on_device(survival, self._upload(cap, torch.int64),
                                                          gamma, K)
                n_rows = R + min(K, sum(min(c, gamma) for c in caps))
                on_device = (dev_lengths, survival, K, source, cap)
            else:
                if self.mode == "dspark" and self.policy.needs_confidence:
                    c_hat, survival = self.calibration.apply(self.to_host(conf))
                else:
                    c_hat = survival = None
                lengths = self.policy.lengths(c_hat, survival, cap, gamma) if self.mode == "dspark" \
                    else FixedPolicy().lengths(None, None, cap, gamma)
                lengths = lengths.tolist()
                # Chains gathered on the device: the drafts never visit the host.
                pick = [i * (gamma + 1) + k for i, n in enumerate(lengths) for k in range(n + 1)]
                ids = chains.view(-1)[self._upload(pick, torch.int64)]
            self._phase("schedule", t0)
        else:
            tokens = z = lse = conf = None
            lengths = [0] * R
            ids = self._upload([r.anchor for r in reqs], torch.int64)
        t0 = time.perf_counter()
        if on_device is not None:
            for r, c in zip(reqs, caps):
                self._grow(r.target_pages, self.talloc, r.kv_len + min(c, gamma) + 1)
            meta, pos, ids, owner = self._meta_on_device(reqs, on_device[0], n_rows, chains)
        else:
            counts = [n + 1 for n in lengths]
            for r, n in zip(reqs, counts):
                self._grow(r.target_pages, self.talloc, r.kv_len + n)
            meta, pos, cu = self._meta([r.target_pages for r in reqs], [r.kv_len for r in reqs],
                                       counts, True)
            owner = None
        if self.graphs is not None:
            logits, feats = self.graphs.verify(ids, pos, meta, self.tcache)
        else:
            logits, feats = self.target.forward(ids, pos, meta, self.tcache, capture_layers=self.capture)
        logits = logits.to(self.logits_dtype)
        raw = logits
        if on_device is None:
            raw = _raw_copy(reqs, logits)
            logits = self._filter(reqs, logits, cu)
        t0 = self._phase("verify_forward", t0)
        acc, out = ops.rejection_sample(logits, meta.cu_q, tokens, z, lse, **rng)
        if self.synthetic is not None and gamma:
            verified = on_device[0] if on_device is not None else self._upload(lengths, torch.int64)
            acc, out = self.synthetic.accept(tokens, verified, logits, meta.cu_q)
        if on_device is None:
            acc, out, failed, _ = self._results(acc, out, logits, cu)
        else:
            dev_lengths, survival, K, source, cap = on_device
            acc, out, failed, extra = self._results(acc, out, logits, owner=owner,
                                                    extra=(dev_lengths, survival))
            lengths = extra[:, 0].long().tolist()
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n + 1)
            self.policy.observe(candidates(extra[:, 1:].float(), cap, gamma), lengths, K, source)
        self._phase("accept", t0)
        has_conf = self.mode == "dspark" and self.drafter.conf_w is not None
        self.rounds += 1
        self.round_host_reads += self.host_reads - reads0
        return RoundResult(acc, out, failed, lengths, raw, cu, feats, conf if has_conf else None)

    def commit_context(self, reqs, starts, counts, feats, row_starts):
        """After commit: drafter context for the anchor and accepted drafts of each request."""
        if self.mode != "ar" and reqs:
            t0 = time.perf_counter()
            self._context_update(reqs, starts, counts, feats, row_starts)
            self._phase("context_update", t0)
