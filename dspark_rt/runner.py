"""One DSpark round for a batch of requests (DESIGN §2), and the prefill that starts them.

Modes share this code: "ar" verifies only the anchor (plain decoding), "dflash" drafts with the
backbone alone and verifies every draft, "dspark" adds the sequential head, the confidence head
and a verify-length policy.
"""
import time
from dataclasses import dataclass

import torch

from . import ops
from .kv_cache import PageAllocator, PagedKVCache
from .logits_process import filter_rows
from .models.batch import AttnMeta
from .policy import Calibration, FixedPolicy, VerifyPolicy
from .request import Request

MODES = ("ar", "dflash", "dspark")


@dataclass
class RoundResult:
    """What one round produced, for commit and for logging (calibration, diagnostics)."""
    num_accepted: torch.Tensor  # [R] int32
    out_tokens: torch.Tensor    # [R, gamma + 1] int64, -1 padded
    lengths: list[int]          # verified drafts per request
    logits: torch.Tensor        # [N, V] target logits of the verify forward
    cu_rows: torch.Tensor       # [R + 1] int32 rows of each request in logits / features
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

    def _meta(self, page_lists, starts, counts, causal):
        """AttnMeta for chains of counts[r] new tokens at positions starts[r].. of each request."""
        ps, dev = self.page_size, self.device
        cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0)
        width = max(1, max(len(p) for p in page_lists))
        tables = torch.zeros(len(page_lists), width, dtype=torch.int32)
        slots, positions = [], []
        for i, (pages, s, n) in enumerate(zip(page_lists, starts, counts)):
            tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            pos = torch.arange(s, s + n)
            page_ids = torch.tensor(pages, dtype=torch.int64)[pos // ps]
            slots.append(page_ids * ps + pos % ps)
            positions.append(pos)
        kv_lens = torch.tensor([s + n for s, n in zip(starts, counts)], dtype=torch.int32)
        meta = AttnMeta(cu.to(dev), kv_lens.to(dev), tables.to(dev),
                        torch.cat(slots).to(dev), causal)
        return meta, torch.cat(positions).to(dev)

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
        meta, pos = self._meta([r.target_pages for r in reqs], starts, counts, True)
        if shared and any(shared):
            lo = meta.cu_q[:-1].tolist()
            for i, n in enumerate(shared):
                meta.slot_mapping[lo[i] : lo[i] + n] = -1
        ids = torch.tensor([t for chunk in tokens for t in chunk], dtype=torch.int64, device=self.device)
        last = (meta.cu_q[1:] - 1).long()
        logits, feats = self.target.forward(ids, pos, meta, self.tcache, capture_layers=self.capture,
                                            logits_rows=last)
        for r, e in zip(reqs, ends):
            r.kv_len = max(r.kv_len, e)
        if self.mode != "ar":
            self._context_update(reqs, starts, counts, feats, meta.cu_q[:-1].tolist())
        return logits.to(self.logits_dtype)

    def _context_update(self, reqs, starts, counts, feats, row_starts):
        """Projects the target features of committed positions starts[r] .. +counts[r] (rows
        row_starts[r] .. of feats) into the drafter's context cache (DESIGN §2 step 7)."""
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(row_starts, counts)]).to(self.device)
        for r, s, n in zip(reqs, starts, counts):
            self._grow(r.drafter_pages, self.dalloc, s + n)
        meta, pos = self._meta([r.drafter_pages for r in reqs], starts, counts, False)
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

    def draft(self, reqs: list[Request]):
        """Parallel drafting then the sequential head. Returns (tokens [R, gamma], z [R, gamma, V],
        lse [R, gamma], conf_logit [R, gamma])."""
        d, B, gamma = self.drafter, self.drafter.block_size, self.gamma
        R = len(reqs)
        for r in reqs:
            self._grow(r.drafter_pages, self.dalloc, r.ctx_len + B)
        # The block's K/V go to scratch slots right after the context; the context update of
        # committed positions overwrites them later.
        meta, pos = self._meta([r.drafter_pages for r in reqs], [r.ctx_len for r in reqs], [B] * R, False)
        anchor = torch.tensor([r.anchor for r in reqs], dtype=torch.int64, device=self.device)
        ids = torch.full((R, B), d.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = anchor
        t0 = self._phase_start()
        hidden = d.forward_block(ids.view(-1), pos, meta, self.dcache).view(R, B, -1)
        h = hidden[:, :gamma] if d.layout == "anchor_first" else hidden[:, 1:]
        h = h.contiguous()
        U = self.target.lm_head(h.reshape(R * gamma, -1)).to(self.logits_dtype).view(R, gamma, -1)
        t0 = self._phase("draft_forward", t0)
        tokens, _, lse, conf = ops.markov_sample(
            U, h.to(self.logits_dtype), anchor, self.head, **self._head_weights,
            **self._rng(reqs))
        self._phase("sequential_head", t0)
        return tokens, U, lse, conf

    def _rng(self, reqs):
        dev = self.device
        seeds = [r.seed - (1 << 64) if r.seed >= (1 << 63) else r.seed for r in reqs]
        return dict(
            temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev),
            seed=torch.tensor(seeds, dtype=torch.int64, device=dev),
            stream=torch.tensor([r.stream for r in reqs], dtype=torch.int64, device=dev),
            round_=torch.tensor([r.round for r in reqs], dtype=torch.int64, device=dev))

    def _filter(self, reqs, logits, cu_rows):
        """Applies each request's top-k / top-p to its rows of target logits."""
        for i, r in enumerate(reqs):
            p = r.params
            if p.greedy or (p.top_k <= 0 and p.top_p >= 1.0):
                continue
            lo, hi = int(cu_rows[i]), int(cu_rows[i + 1])
            rows = logits[lo:hi]
            kept = filter_rows(rows / p.temperature, p.top_k, p.top_p)
            logits[lo:hi] = rows.masked_fill(torch.isinf(kept) & ~torch.isinf(rows), float("-inf"))
        return logits

    def sample_first(self, reqs: list[Request], logits: torch.Tensor):
        """The token after the prompt: a round with no drafts (round 0)."""
        R = len(reqs)
        cu = torch.arange(R + 1, dtype=torch.int32, device=self.device)
        logits = self._filter(reqs, logits, cu)
        acc, out = ops.rejection_sample(logits, cu, None, None, None, **self._rng(reqs))
        return logits, cu, acc, out

    def step(self, reqs: list[Request]) -> RoundResult:
        """One round for requests whose anchor is set."""
        R, gamma = len(reqs), self.gamma
        if gamma:
            tokens, z, lse, conf = self.draft(reqs)
            t0 = time.perf_counter()
            # The target's own token is emitted too, and the chain must stay inside the context.
            cap = torch.tensor([max(0, min(r.remaining - 1, self.max_len - 2 - r.kv_len))
                                for r in reqs], dtype=torch.int64)
            if self.mode == "dspark" and self.policy.needs_confidence:
                c_hat, survival = self.calibration.apply(conf.cpu())
            else:
                c_hat = survival = None
            lengths = self.policy.lengths(c_hat, survival, cap, gamma) if self.mode == "dspark" \
                else FixedPolicy().lengths(None, None, cap, gamma)
            lengths = lengths.tolist()
            drafts = tokens.tolist()  # one device-to-host copy for the whole batch
            chains = [[r.anchor] + drafts[i][: lengths[i]] for i, r in enumerate(reqs)]
            self._phase("schedule", t0)
        else:
            tokens = z = lse = conf = None
            lengths = [0] * R
            chains = [[r.anchor] for r in reqs]
        t0 = time.perf_counter()
        counts = [len(c) for c in chains]
        for r, n in zip(reqs, counts):
            self._grow(r.target_pages, self.talloc, r.kv_len + n)
        meta, pos = self._meta([r.target_pages for r in reqs], [r.kv_len for r in reqs], counts, True)
        ids = torch.tensor([t for c in chains for t in c], dtype=torch.int64, device=self.device)
        logits, feats = self.target.forward(ids, pos, meta, self.tcache, capture_layers=self.capture)
        logits = self._filter(reqs, logits.to(self.logits_dtype), meta.cu_q)
        t0 = self._phase("verify_forward", t0)
        acc, out = ops.rejection_sample(logits, meta.cu_q, tokens, z, lse, **self._rng(reqs))
        self._phase("accept", t0)
        has_conf = self.mode == "dspark" and self.drafter.conf_w is not None
        return RoundResult(acc, out, lengths, logits, meta.cu_q, feats, conf if has_conf else None)

    def commit_context(self, reqs, starts, counts, feats, row_starts):
        """After commit: drafter context for the anchor and accepted drafts of each request."""
        if self.mode != "ar" and reqs:
            t0 = time.perf_counter()
            self._context_update(reqs, starts, counts, feats, row_starts)
            self._phase("context_update", t0)
