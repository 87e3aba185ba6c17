"""Which requests run each step: FIFO queues, chunked prefill mixed with DSpark rounds under a
per-step token budget, admission by free pages with a watermark, preemption by recompute.

Pure Python. The request objects are the engine's; the scheduler reads and writes only the
fields of SchedRequest (see its docstring for who maintains what). Token and page accounting is
recomputed from the requests and the block managers at every schedule(), never carried over.
"""
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager

__all__ = ["SchedRequest", "PrefillChunk", "SchedulerOutput", "RequestScheduler"]


@dataclass(eq=False)  # identity: two requests are never "equal"
class SchedRequest:
    """The fields the scheduler uses (dspark_rt.engine.request.Request has them too; max_tokens may
    instead be params.max_tokens).

    The engine appends committed tokens to output_ids and reports progress through
    prefilled() and decoded(). The scheduler is the one writer of kv_len and ctx_len
    (positions 0..kv_len-1 are in the target cache, 0..ctx_len-1 have drafter context; between
    steps a decoding request has kv_len == len(prompt_ids) + len(output_ids) - 1, its anchor
    being output_ids[-1], and ctx_len == kv_len unless ctx_deferred: then the round holds the
    features of positions ctx_len .. kv_len-1 and writes their drafter context before the
    request drafts again) and of target_pages, drafter_pages (copies of the block tables, set
    for every scheduled request); preemption resets all five."""
    request_id: object
    prompt_ids: list[int]
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    ctx_len: int = 0
    ctx_deferred: bool = False
    target_pages: list[int] = field(default_factory=list)
    drafter_pages: list[int] = field(default_factory=list)
    needs_prompt_rows: bool = False  # every prefill position's logits are read: no prefix hit


@dataclass
class PrefillChunk:
    """Run tokens (prompt_ids + output_ids)[start : start + num_tokens] at positions start.. .
    Target K/V is written only for positions >= target_from (those below sit in shared cached
    pages, which the chunk reads: point their slots at a scratch page, e.g. one extra page of
    the PagedKVCache beyond the BlockManager's num_pages); drafter context is written for the
    whole chunk (start == ctx_len <= kv_len == target_from).
    Afterwards kv_len = max(kv_len, end) and ctx_len = end. If is_last and the request has no
    output yet, sample its first token from the last position's logits (round 0); if is_last
    and it has output (resumed after preemption), its anchor is output_ids[-1], no sampling."""
    req: object
    start: int
    num_tokens: int
    target_from: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_last(self) -> bool:
        return self.end == prefill_len(self.req)


@dataclass
class SchedulerOutput:
    decodes: list = field(default_factory=list)     # requests running one DSpark round
    prefills: list = field(default_factory=list)    # PrefillChunk
    preempted: list = field(default_factory=list)   # requests sent back to waiting this step
    num_batched_tokens: int = 0                     # target forward tokens, worst case

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


def all_tokens(req, n: int | None = None) -> "_Tokens":
    """prompt_ids + output_ids (the first n of them), as a view."""
    return _Tokens(req.prompt_ids, req.output_ids, n)


def prefill_len(req) -> int:
    """Positions a (re-)prefill must fill: the prompt, plus every emitted token but the last
    (the anchor) once the request has output."""
    return len(req.prompt_ids) + max(0, len(req.output_ids) - 1)


def _max_tokens(req) -> int:
    return req.max_tokens if hasattr(req, "max_tokens") else req.params.max_tokens


class _Tokens:
    """prompt_ids + output_ids, cut at n, without copying them every step (len and slices
    only: commit_full_pages then touches only the pages it has not hashed yet)."""

    def __init__(self, a, b, n=None):
        self.a, self.b = a, b
        self.n = len(a) + len(b) if n is None else min(n, len(a) + len(b))

    def __len__(self):
        return self.n

    def __getitem__(self, s):
        if isinstance(s, int):
            if not 0 <= s < self.n:
                raise IndexError(s)
            return self.a[s] if s < len(self.a) else self.b[s - len(self.a)]
        lo, hi, _ = s.indices(len(self))
        n = len(self.a)
        return list(self.a[lo:min(hi, n)]) + list(self.b[max(lo - n, 0):max(hi - n, 0)])


class RequestScheduler:
    """gamma: drafts per round (0 for plain decoding); block_size: drafter block length.
    drafter_blocks None: no drafter ("ar"). A decode round costs 1 + gamma budget tokens (the
    verify forward's worst case); a prefill chunk its number of tokens. Before a round the
    drafter table covers kv_len + max(block_size, gamma + 1): the block scratch, and the
    context update of anchor + up to gamma accepted drafts after it (gamma + 1 > block_size
    with the anchor-first layout, where block_size == gamma)."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, target_blocks: BlockManager,
                 drafter_blocks: BlockManager | None = None, *, gamma: int = 0, block_size: int = 0,
                 chunk_size: int | None = None, watermark: float = 0.01):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if gamma < 0 or (drafter_blocks is not None and block_size < 1):
            raise ValueError(f"gamma must be >= 0 and block_size >= 1 with a drafter, got "
                             f"gamma={gamma}, block_size={block_size}")
        if max_num_batched_tokens < 1 + gamma:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must hold one "
                             f"round: >= 1 + gamma = {1 + gamma}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must lie in [0, 1), got {watermark}")
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.target, self.drafter = target_blocks, drafter_blocks
        self.gamma, self.block_size = gamma, block_size if drafter_blocks is not None else 0
        self.drafter_reach = max(self.block_size, gamma + 1) if drafter_blocks is not None else 0
        self.chunk_size = chunk_size or max_num_batched_tokens
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.watermark = watermark
        self.waiting: deque = deque()
        self.running: list = []
        self._live: dict = {}
        self.num_preemptions = 0

    # -- queues ------------------------------------------------------------------------------

    def add(self, req) -> None:
        rid = req.request_id
        if rid in self._live:
            raise ValueError(f"request {rid!r} is already scheduled")
        if not req.prompt_ids:
            raise ValueError(f"request {rid!r}: empty prompt")
        # The most a request ever holds must fit alone, or no preemption lets it finish.
        for bm, n in zip((self.target, self.drafter), self.lifetime(req)):
            if bm is not None and bm.pages_for(n) > bm.num_pages:
                raise ValueError(f"request {rid!r}: up to {n} positions need {bm.pages_for(n)} "
                                 f"pages of {bm.page_size}, the {bm.name} cache has {bm.num_pages}")
        req.kv_len = req.ctx_len = 0
        req.ctx_deferred = False
        self.waiting.append(req)
        self._live[rid] = req

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def lifetime(self, req) -> tuple[int, int]:
        """Positions the request holds at most in the target and the drafter cache (kv_len <=
        P + max_tokens - 2 while it decodes, plus a round's chain or the drafter's block)."""
        top = len(req.prompt_ids) + _max_tokens(req)
        return top + self.gamma, top + self.drafter_reach

    def prefilled(self, chunk: "PrefillChunk") -> None:
        """The engine ran the chunk: its positions are in both caches."""
        req = chunk.req
        req.kv_len, req.ctx_len = max(req.kv_len, chunk.end), chunk.end
        req.ctx_deferred = False

    def decoded(self, req, n: int, context: bool = True) -> None:
        """The engine committed a round of the request: anchor + accepted drafts, n positions,
        are in the target cache and, with context, (written by the round) in the drafter
        context; without, the round deferred their drafter context (it keeps their features)
        and ctx_len stays where the context ends."""
        req.kv_len += n
        if context:
            req.ctx_len, req.ctx_deferred = req.kv_len, False
        else:
            req.ctx_deferred = True

    def __contains__(self, request_id) -> bool:
        return request_id in self._live

    def abort(self, request_id) -> bool:
        """Drops the request wherever it is and frees its pages; False if it is not live."""
        req = self._live.get(request_id)
        if req is None:
            return False
        self._dequeue(req)
        self._release(req, commit=False)
        return True

    def finish(self, request_id) -> None:
        """The engine saw a stop: caches the request's committed full pages, frees the rest."""
        req = self._live.get(request_id)
        if req is None:
            raise KeyError(f"RequestScheduler.finish: request {request_id!r} is not live "
                           f"(unknown, finished or aborted)")
        self._release(req, commit=self._dequeue(req))

    def _dequeue(self, req) -> bool:
        """Removes the request (by identity) from its queue; True if it was running."""
        for queue in (self.running, self.waiting):
            for i, r in enumerate(queue):
                if r is req:
                    del queue[i]
                    return queue is self.running
        raise AssertionError(f"request {req.request_id!r} is live but in no queue")

    def _release(self, req, commit: bool):
        if commit:
            self._commit(req)
        for bm in (self.target, self.drafter):
            if bm is not None and bm.has_seq(req.request_id):
                bm.free(req.request_id)
        req.target_pages, req.drafter_pages = [], []
        del self._live[req.request_id]

    def _commit(self, req):
        """Offers the committed full pages to the prefix caches (never speculative positions:
        a stop inside the accepted drafts can leave kv_len past the emitted tokens)."""
        rid = req.request_id
        if self.target.fills_pages(rid, req.kv_len):
            self.target.commit_full_pages(rid, all_tokens(req, req.kv_len))
        if self.drafter is not None and self.drafter.fills_pages(rid, req.ctx_len):
            self.drafter.commit_full_pages(rid, all_tokens(req, req.ctx_len))

    # -- one step ----------------------------------------------------------------------------

    def _cursor(self, req) -> int:
        """First position not yet prefilled in both caches (ctx_len <= kv_len always; a deferred
        drafter context is the round's to write, not a prefill's)."""
        return req.kv_len if self.drafter is None or req.ctx_deferred else req.ctx_len

    def _fits(self, req, n_target: int, n_drafter: int) -> bool:
        rid = req.request_id
        return self.target.can_allocate(n_target, rid) and (
            self.drafter is None or self.drafter.can_allocate(n_drafter, rid))

    def _grow(self, req, n_target: int, n_drafter: int):
        """Covers the positions; the request's page lists are new copies whenever its tables
        grew (a table changes only by growing here, or by a release that empties the list)."""
        rid = req.request_id
        if self.target.allocate(rid, n_target) or not req.target_pages:
            req.target_pages = self.target.block_table(rid)
        if self.drafter is not None and (self.drafter.allocate(rid, n_drafter) or not req.drafter_pages):
            req.drafter_pages = self.drafter.block_table(rid)

    def _preempt(self, req, out: SchedulerOutput):
        """Recompute: free everything; re-prefill of prompt + emitted tokens rebuilds both
        caches (the drafter context included) when the request is admitted again."""
        self._dequeue(req)
        for bm in (self.target, self.drafter):
            if bm is not None:
                bm.free(req.request_id)
        req.kv_len = req.ctx_len = 0
        req.ctx_deferred = False
        req.target_pages, req.drafter_pages = [], []
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in self.running:
            self._commit(req)
        # Running requests, oldest first; the newest are preempted when pages run out.
        i = 0
        while i < len(self.running):
            req = self.running[i]
            start, plen = self._cursor(req), prefill_len(req)
            if start >= plen and not req.output_ids:
                raise RuntimeError(f"request {req.request_id!r} finished its prefill without a "
                                   f"first token: sample it after the last chunk (is_last)")
            if start < plen:
                n = min(plen - start, self.chunk_size, budget)
                cost, n_target, n_drafter = n, max(req.kv_len, start + n), start + n
            else:
                n = cost = 1 + self.gamma
                n_target, n_drafter = req.kv_len + 1 + self.gamma, req.kv_len + self.drafter_reach
            if n <= 0 or cost > budget:
                i += 1
                continue
            fits = self._fits(req, n_target, n_drafter)
            while not fits and self.running[-1] is not req:
                self._preempt(self.running[-1], out)
                fits = self._fits(req, n_target, n_drafter)
            if not fits:
                self._preempt(req, out)
                break
            self._grow(req, n_target, n_drafter)
            budget -= cost
            if start < plen:
                out.prefills.append(PrefillChunk(req, start, n, req.kv_len))
            else:
                out.decodes.append(req)
            i += 1
        # Waiting requests, FIFO, unless this step had to preempt. The watermark keeps room for
        # running requests to grow; with nothing running it is waived so the queue never stalls.
        while (not out.preempted and self.waiting and len(self.running) < self.max_num_seqs
               and budget > 0):
            req = self.waiting[0]
            if not self._admit(req, budget, out):
                break
            budget -= out.prefills[-1].num_tokens
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _admit(self, req, budget: int, out: SchedulerOutput) -> bool:
        rid, toks, plen = req.request_id, all_tokens(req), prefill_len(req)
        # Keep the last prefill position uncached: its logits (or at least one forward) are
        # needed; all of them when the request reads every position's logits (prompt
        # log-probabilities: recomputing a hit costs the same forward as bypassing it). The
        # drafter may hit less (pages evicted, caching off, another page size); its hit is cut
        # to the target's and the chunk starts there: ctx <= kv (see PrefillChunk).
        t_pages = self.target.lookup_prefix(toks, 0 if req.needs_prompt_rows else plen - 1)
        kv = len(t_pages) * self.target.page_size
        d_pages = [] if self.drafter is None else self.drafter.lookup_prefix(toks, kv)
        ctx = kv if self.drafter is None else len(d_pages) * self.drafter.page_size
        start = ctx
        n = min(plen - start, self.chunk_size, budget)
        wm = self.watermark if self.running else 0.0
        if not self.target.can_admit(max(kv, start + n), wm, t_pages):
            return False
        if self.drafter is not None and not self.drafter.can_admit(start + n, wm, d_pages):
            return False
        self.waiting.popleft()
        self.target.match_prefix(rid, toks, kv)
        if self.drafter is not None:
            self.drafter.match_prefix(rid, toks, ctx)
        req.kv_len, req.ctx_len = kv, ctx
        self._grow(req, max(kv, start + n), start + n)
        self.running.append(req)
        out.prefills.append(PrefillChunk(req, start, n, kv))
        return True
