"""Continuous batching: requests arrive and leave between rounds.

Engine.add_request / abort / step for callers that run their own loop; Engine.stream yields each
request's new tokens as they are committed. The request scheduler decides every step which
requests prefill (in chunks) and which run a DSpark round; the block managers hand out KV pages;
the runner does the work. Decoder.generate and Decoder.stream run on an Engine too.

An Engine owns its runner's KV caches: a newer Engine on the same Decoder allocates new ones,
and the older Engine refuses to step from then on.
"""
from dataclasses import dataclass

from ..outputs import RequestOutput
from .block_manager import BlockManager
from .config import EngineConfig
from .scheduler import RequestScheduler, all_tokens


_BAD_LOGITS = "NaN or inf in the target's logits"


@dataclass
class StepOutput:
    """What one request got from one step: new tokens, and whether it is done."""
    request_id: int
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None  # set when finished
    error: str | None = None


class Engine:
    """decoder: a Decoder (its models, mode, policy and runner); config: an EngineConfig, or its
    fields as keywords."""

    def __init__(self, decoder, config: EngineConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError(f"Engine: pass an EngineConfig or keywords, not both (got {sorted(kwargs)})")
        config = config if config is not None else EngineConfig(**kwargs)
        self.config = config
        num_pages, enable_prefix_caching = config.num_pages, config.enable_prefix_caching
        self.decoder, self.runner = decoder, decoder.runner
        r = self.runner
        r.allocate_caches(num_pages)
        r.owner = self
        self.num_pages = num_pages
        # Full pages of committed tokens are shared between requests with the same prefix (hash of
        # the token ids). Drafter context is a function of the prefix too, so its pages are cached
        # alike; where the drafter hit is shorter, its context is rebuilt from target features.
        self.target_blocks = BlockManager(num_pages, r.page_size,
                                          enable_prefix_caching=enable_prefix_caching, name="target")
        self.drafter_blocks = None
        if r.mode != "ar":
            self.drafter_blocks = BlockManager(num_pages, r.page_size,
                                               enable_prefix_caching=enable_prefix_caching,
                                               name="drafter")
        block = decoder.drafter.block_size if r.mode != "ar" else 0
        self.scheduler = RequestScheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                          self.target_blocks, self.drafter_blocks, gamma=r.gamma,
                                          block_size=block, chunk_size=config.chunk_size,
                                          watermark=config.watermark)
        self.requests = {}

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt, params=None) -> int:
        """Checks and queues one request; returns its id. Bad input raises ValueError naming the
        argument, and nothing else is affected."""
        from ..sampling_params import SamplingParams
        req = self.decoder._make_request(len(self.requests), prompt, params or SamplingParams())
        return self._add(req)

    def _add(self, req) -> int:
        """Queues a request the Decoder already checked (Decoder.generate checks a whole batch
        before queueing any)."""
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req.request_id

    def abort(self, request_id: int) -> bool:
        """Drops a request wherever it is; its pages go back to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        req.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ------------------------------------------------------------------------------

    @property
    def owns_caches(self) -> bool:
        return getattr(self.runner, "owner", None) is self

    def step(self) -> list[StepOutput]:
        if not self.owns_caches:
            raise RuntimeError("Engine.step: a newer Engine on the same Decoder replaced this one's "
                               "KV caches; use that Engine")
        out = self.scheduler.schedule()
        before = {rid: len(r.output_ids) for rid, r in self.requests.items()}
        errors = {}
        for req in out.preempted:  # re-prefill rebuilds both caches; the anchor is kept
            req.anchor = req.output_ids[-1] if req.output_ids else -1
        if out.prefills:
            errors.update(self._prefill(out.prefills))
        if out.decodes:
            errors.update(self._decode(out.decodes))
        results = []
        for rid, req in list(self.requests.items()):
            new = req.output_ids[before.get(rid, 0):]
            if not (new or req.finished or rid in errors):
                continue
            if rid in errors:
                req.finish_reason, req.error = "error", errors[rid]
            done = req.finished
            if done:
                self.scheduler.finish(rid)
                del self.requests[rid]
            results.append(StepOutput(rid, list(new), done,
                                      self.decoder._output(req) if done else None, errors.get(rid)))
        return results

    def _prefill(self, chunks) -> dict:
        runner, dec = self.runner, self.decoder
        reqs = [c.req for c in chunks]
        logits = runner.prefill_chunks(reqs, [c.start for c in chunks], [c.end for c in chunks],
                                       [list(all_tokens(c.req)[c.start:c.end]) for c in chunks],
                                       [min(c.num_tokens, max(0, c.target_from - c.start))
                                        for c in chunks])
        first = [i for i, c in enumerate(chunks) if c.is_last and not c.req.output_ids]
        for c in chunks:
            if c.is_last and c.req.output_ids:  # resumed after preemption: nothing to sample
                c.req.anchor = c.req.output_ids[-1]
        if not first:
            return {}
        sel = [reqs[i] for i in first]
        lg, toks, failed = runner.sample_first(sel, logits[first])
        errors = {r.request_id: _BAD_LOGITS for r, f in zip(sel, failed) if f}
        ok = [i for i, f in enumerate(failed) if not f]
        dec._apply([sel[i] for i in ok], [toks[i] for i in ok], lg, ok)
        return errors

    def _decode(self, reqs) -> dict:
        runner, dec = self.runner, self.decoder
        starts = [r.kv_len for r in reqs]
        res = runner.step(reqs)
        # A request whose target logits hold NaN or +inf fails alone; the others go on.
        errors = {r.request_id: _BAD_LOGITS for r, f in zip(reqs, res.failed) if f}
        if dec.round_log is not None:
            dec.round_log.append(dec._log_entry(reqs, res))
        ok = [i for i, f in enumerate(res.failed) if not f]
        cu = res.cu_rows
        emitted = dec._apply([reqs[i] for i in ok], [res.out_tokens[i] for i in ok], res.logits,
                             [cu[i] for i in ok], [res.lengths[i] for i in ok])
        keep = [(i, n) for i, n in zip(ok, emitted) if not reqs[i].finished]
        runner.commit_context([reqs[i] for i, _ in keep], [starts[i] for i, _ in keep],
                              [n for _, n in keep], res.features, [cu[i] for i, _ in keep])
        return errors

    # -- streaming -----------------------------------------------------------------------------

    def stream(self, prompt, params=None):
        """Adds one request and yields StepOutput deltas for it until it finishes (other queued
        requests advance too)."""
        return self._stream(self.requests[self.add_request(prompt, params)])

    def _stream(self, req):
        """Deltas read from the request itself, so that several streams (or a generate call)
        stepping the same Engine never take each other's tokens. Closing the generator early
        aborts the request."""
        sent = 0
        try:
            while True:
                new = req.output_ids[sent:]
                if new or req.finished:
                    sent += len(new)
                    done = req.finished
                    yield StepOutput(req.request_id, list(new), done,
                                     self.decoder._output(req) if done else None, req.error)
                    if done:
                        return
                self.step()
        finally:
            if not req.finished and self.owns_caches:
                self.abort(req.request_id)
