"""Continuous batching: requests arrive and leave between rounds; the engine owns them and the loop.

Each step the request scheduler decides which requests prefill (in chunks) and which run a
DSpark round, the runner does the work (prefill, Round), the Processor commits what came back.
add_request / abort / step for callers that run their own loop (safe to call from several
threads: one lock serialises them); stream() yields a request's new tokens as they commit;
run() drives a batch to the end. The Decoder is a facade over one Engine.

An Engine owns its runner's KV caches: a newer Engine on the same runner allocates new ones, and
the older Engine refuses to step from then on.
"""
import itertools
import logging
import threading
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ..outputs import RequestOutput, SpecMetrics
from ..policies import Calibration, FixedPolicy, VerifyPolicy
from ..batch import SamplingBatch, SeqBatch
from ..runner.round import Round, first_token
from ..runner.runner import prefill_rows
from ..runner.state import RoundState
from ..sampling_params import SamplingParams
from . import prompt_logprobs
from .block_manager import BlockManager
from .config import EngineConfig, EngineLimits
from .processing import Processor
from .scheduler import RequestScheduler, all_tokens

log = logging.getLogger(__name__)
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
    """runner: a runner.Runner (models, mode, caches); config: an EngineConfig, or its fields as
    keywords. policy: the VerifyPolicy of dspark mode (other modes verify every draft);
    calibration: STS temperatures of the confidences. tokenizer, eos_token_ids: text in and out,
    stop tokens. seed: the Philox key of requests without their own; request_ids: the id (and
    random stream) counter, shared by the Engines of one Decoder. limits: an EngineLimits, the
    caps reserve() keeps to."""

    def __init__(self, runner, config: EngineConfig | None = None, *, policy: VerifyPolicy | None = None,
                 calibration: Calibration | None = None, tokenizer=None, eos_token_ids=(),
                 seed: int = 0, request_ids=None, limits: EngineLimits | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError(f"Engine: pass an EngineConfig or keywords, not both (got {sorted(kwargs)})")
        self.config = config if config is not None else EngineConfig(**kwargs)
        self.runner, self.limits = runner, limits or EngineLimits()
        self.policy = policy if runner.mode == "dspark" and policy is not None else FixedPolicy()
        if self.policy.needs_confidence and not runner.has_confidence:
            raise ValueError(f"policy {self.policy.name!r} needs a confidence head, which this "
                             "drafter lacks")
        self.calibration = calibration or Calibration.identity(max(runner.gamma, 1))
        self.tokenizer = tokenizer
        self.processor = Processor(tokenizer, vocab_size=runner.target.config.vocab_size,
                                   max_model_len=runner.max_len, eos_token_ids=eos_token_ids,
                                   gamma=runner.gamma)
        self.round = Round()  # benchmarks swap in a subclass (dspark_rt.testing)
        # what lives across rounds (deferred drafter context; the policy's per-request memory
        # through it): told of every add, finish, abort and preemption below
        self.state = RoundState(self.policy, self.policy.defers_context and runner.defers_context)
        self.round_log: list[dict] | None = None  # set to a list to record every round
        self.num_rounds = self.round_host_reads = 0  # rounds run, device reads inside them
        self.seed = seed
        self._ids = request_ids if request_ids is not None else itertools.count()
        self._lock = threading.RLock()
        self.requests: dict[int, object] = {}
        self._build(self.config)

    def _build(self, config: EngineConfig):
        """Caches and block managers for config (the runner's old caches go first)."""
        r = self.runner
        self._lease = None
        self._lease = r.lease_caches(config.num_pages)
        self.config = config
        # Full pages of committed tokens are shared between requests with the same prefix (hash
        # of the token ids). Drafter context is a function of the prefix too, so its pages are
        # cached alike; where the drafter hit is shorter, its context is rebuilt from features.
        blocks = lambda name: BlockManager(config.num_pages, r.page_size, name=name,
                                           enable_prefix_caching=config.enable_prefix_caching)
        self.target_blocks = blocks("target")
        self.drafter_blocks = blocks("drafter") if r.drafter is not None else None
        self.scheduler = RequestScheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                          self.target_blocks, self.drafter_blocks, gamma=r.gamma,
                                          block_size=r.block_size, chunk_size=config.chunk_size,
                                          watermark=config.watermark)

    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    @property
    def owns_caches(self) -> bool:
        """Whether this Engine's lease on the runner's caches is the current one."""
        return self._lease is not None and self.runner.lease is self._lease

    # -- requests ----------------------------------------------------------------------------

    def make_request(self, prompt, params=None, index=0):
        """A checked Request, not queued (errors name request `index` and the argument)."""
        with self._lock:
            rid = next(self._ids)
        req = self.processor.request(index, prompt, params if params is not None else SamplingParams(),
                                     rid, self.seed, rid + 1)
        try:  # bad words as token ids, allowed ids in the vocabulary
            req.params.update_from_tokenizer(self.processor.tokenizer, self.processor.vocab_size)
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from None
        if req.params.structured_outputs is not None:  # outside the lock: rounds go on meanwhile
            self.compile_grammar(req.params.structured_outputs)
        return req

    def add_request(self, prompt, params=None) -> int:
        """Checks and queues one request; returns its id. Bad input raises ValueError naming the
        argument, and nothing else is affected."""
        return self.add(self.make_request(prompt, params))

    def add(self, req) -> int:
        """Queues a request from make_request."""
        with self._lock:
            if req.params.structured_outputs is not None:  # compiled by make_request: a look-up
                self.compile_grammar(req.params.structured_outputs)
            self.scheduler.add(req)
            self.state.add(req.request_id)
            self.requests[req.request_id] = req
        return req.request_id

    def compile_grammar(self, spec):
        """Checks that this Engine can serve a structured-output request and compiles its grammar
        (cached per grammar and tokenizer): a ValueError naming the field, before any work. Takes
        no engine lock, so a large schema compiles in the caller's thread while rounds run (the
        server calls it from a worker thread before it queues the request)."""
        c = self.state.constraints
        if c.compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the target's tokenizer.json (none loaded)")
            if getattr(self.runner, "group", None) is not None:
                raise ValueError("structured_outputs is not served under tensor parallelism")
            from ..structured.grammar import grammar_book
            c.compiler = grammar_book(self.tokenizer, self.runner.target.config.vocab_size)
        if hasattr(c.compiler, "compile"):  # a GrammarBook (tests may give a bare matcher factory)
            c.compiler.compile(spec)

    def _grammar_end(self, req):
        """Records whether a finished request's text is a whole match of its grammar; one that
        ran out of tokens first says so in its output and in the log."""
        req.grammar_complete = bool(self.state.constraints.complete(req.request_id))
        if not req.grammar_complete and req.finish_reason == "length":
            log.info("request %s: max_tokens=%s (or the context) ended it before its grammar "
                        "completed: the text is a prefix of a match, not a match",
                        req.request_id, req.params.max_tokens)

    def abort(self, request_id: int) -> bool:
        """Drops a request wherever it is; its pages go back to the pool."""
        with self._lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            self.scheduler.abort(request_id)
            self.state.abort(request_id)
            self.processor.abort(req)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        """Requests admitted to the batch (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued, not yet admitted (or preempted)."""
        return len(self.scheduler.waiting)

    def pages_needed(self, reqs) -> int:
        """Pages per cache that hold these requests' whole lifetimes at once."""
        pages = self.target_blocks.pages_for
        target = sum(pages(self.scheduler.lifetime(q)[0]) for q in reqs)
        drafter = sum(pages(self.scheduler.lifetime(q)[1]) for q in reqs) if self.drafter_blocks else 0
        return max(target, drafter)

    def resize(self, config: EngineConfig):
        """New caches and block managers (the prefix cache starts empty); only when idle."""
        with self._lock:
            if self.has_unfinished():
                raise RuntimeError("Engine.resize: requests are still running")
            self._build(config)

    def reserve(self, reqs, min_pages: int = 0):
        """Sizes the pool for these checked requests before they are queued: when idle and too
        small for their whole lifetimes at once, the pool is resized (offline batches then run
        without preemption); while other requests run they share the pool as it is (with
        preemption when short), unless one of these could never fit it: then the running
        requests finish first and the pool is resized. min_pages is capped by what the requests'
        contexts can use (a request never makes the pool larger than its context needs)."""
        r, cap = self.runner, self.limits.cap
        seqs = cap("max_num_seqs", len(reqs))
        budget = cap("max_num_batched_tokens", max(8192, len(reqs) * (1 + r.gamma)))
        busy = self.owns_caches and self.has_unfinished()
        if busy and any(self.pages_needed([q]) > self.num_pages for q in reqs):
            while self.has_unfinished():  # other threads' requests and open streams finish here
                self.step()
            busy = False
        if busy:
            seqs = cap("max_num_seqs", seqs + len(self.requests))
            budget = cap("max_num_batched_tokens", max(budget, seqs * (1 + r.gamma)))
        else:  # pages for the `seqs` longest lifetimes (more never run at once)
            need = self.pages_needed(sorted(reqs, key=lambda q: -self.pages_needed([q]))[:seqs])
            full = self.target_blocks.pages_for(r.max_len + r.block_size + r.gamma)
            need = max(min(min_pages, full * seqs), need + need // 50 + 1)  # + the watermark
            need = cap("max_num_pages", need)  # a request that cannot fit it alone: add() says so
            if not self.owns_caches or self.num_pages < need:
                self.resize(replace(self.config, num_pages=need, max_num_seqs=seqs,
                                    max_num_batched_tokens=budget, chunk_size=budget))
        self.scheduler.max_num_seqs = max(self.scheduler.max_num_seqs, seqs)
        self.scheduler.max_num_batched_tokens = max(self.scheduler.max_num_batched_tokens, budget)

    def output(self, req) -> RequestOutput:
        return self.processor.output(req)

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        with self._lock:
            if not self.owns_caches:
                raise RuntimeError("Engine.step: a newer Engine on the same runner replaced this "
                                   "one's KV caches; use that Engine")
            out = self.scheduler.schedule()
            for req in out.preempted:  # its caches are recomputed: nothing deferred holds
                self.state.preempt(req.request_id)
            before = {rid: len(r.output_ids) for rid, r in self.requests.items()}
            errors = {}
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
                    self.processor.fail(req, errors[rid])
                if req.finished:
                    if req.params.structured_outputs is not None:
                        self._grammar_end(req)
                    self.scheduler.finish(rid)
                    self.state.finish(rid)
                    del self.requests[rid]
                results.append(StepOutput(rid, list(new), req.finished,
                                          self.output(req) if req.finished else None, errors.get(rid)))
            return results

    def _batch(self, reqs) -> SeqBatch:
        """What the runner reads of these requests (caps: drafts each may verify, so that its
        target token fits max_tokens and the chain the context)."""
        max_len, spec = self.runner.max_len, self.limits.cap("num_speculative_tokens", self.runner.gamma)
        return SeqBatch([r.kv_len for r in reqs], [r.ctx_len for r in reqs],
                        [r.target_pages for r in reqs], [r.drafter_pages for r in reqs],
                        [r.anchor for r in reqs],
                        [max(0, min(r.remaining - 1, max_len - 2 - r.kv_len, spec)) for r in reqs],
                        SamplingBatch.of([r.params for r in reqs], [r.output_ids for r in reqs],
                                         self.processor.eos_token_ids), [r.seed for r in reqs],
                        [r.stream for r in reqs],
                        [len(r.output_ids) if r.params.coupled else r.round for r in reqs],
                        [r.request_id for r in reqs])

    def _prefill(self, chunks) -> dict:
        reqs = [c.req for c in chunks]
        batch = self._batch(reqs)
        # requests that asked for prompt log-probabilities read every row of their chunks
        every = [r.needs_prompt_rows for r in reqs]
        logits = self.runner.prefill(batch, [c.start for c in chunks], [c.end for c in chunks],
                                     [list(all_tokens(c.req)[c.start:c.end]) for c in chunks],
                                     [min(c.num_tokens, max(0, c.target_from - c.start))
                                      for c in chunks], every if any(every) else None)
        if any(every):
            first, last = prefill_rows([c.num_tokens for c in chunks], every)
            prompt_logprobs.record([c for c, e in zip(chunks, every) if e],
                                   [f for f, e in zip(first, every) if e], logits,
                                   self.runner.to_host)
            logits = logits[self.runner.upload(last, torch.int64)]
        for c in chunks:  # a request resumed after preemption keeps its anchor: nothing to sample
            self.scheduler.prefilled(c)
        first = [i for i, c in enumerate(chunks) if c.is_last and not c.req.output_ids]
        if not first:
            return {}
        sel = [reqs[i] for i in first]
        raw, toks, failed = first_token(self.runner, batch.select(first), logits[first], self.state)
        self._commit(sel, toks, failed, raw, list(range(len(sel))))
        return {r.request_id: _BAD_LOGITS for r, f in zip(sel, failed) if f}

    def _decode(self, reqs) -> dict:
        reads = self.runner.host_reads
        batch = self._batch(reqs)
        decision = self.policy.decide(self.state.view(batch, self.runner.gamma))
        res = self.runner.run_round(self.round, batch, decision, self.policy, self.calibration,
                                    self.state)
        self.num_rounds += 1
        self.round_host_reads += self.runner.host_reads - reads
        self.policy.observe(res)
        # every verified draft is a label for the next rounds' calibration (OnlineCalibration)
        self.calibration.observe(res.conf_logit, res.lengths, res.num_accepted)
        if self.round_log is not None:
            self.round_log.append(self._log_entry(reqs, res))
        self._commit(reqs, res.out_tokens, res.failed, res.logits, res.cu_rows[:-1], res.lengths,
                     res.nonfinite)
        for r, f, a, ctx in zip(reqs, res.failed, res.num_accepted, res.context):
            if not f:  # anchor and accepted drafts entered the target cache (and, with ctx, the
                self.scheduler.decoded(r, a + 1, ctx)  # drafter's: else the state holds them)
        # a request whose target logits hold NaN or +inf fails alone; the others go on
        return {r.request_id: _BAD_LOGITS for r, f in zip(reqs, res.failed) if f}

    def _commit(self, reqs, tokens, failed, logits, row_starts, lengths=None, nonfinite=()):
        ok = [i for i, f in enumerate(failed) if not f]
        lp = self.processor.logprobs([reqs[i] for i in ok], [tokens[i] for i in ok], logits,
                                     [row_starts[i] for i in ok], self.runner.to_host)
        for j, i in enumerate(ok):
            self.processor.commit(reqs[i], tokens[i], lp.get(j),
                                  None if lengths is None else lengths[i],
                                  bool(nonfinite) and nonfinite[i])

    def _log_entry(self, reqs, res) -> dict:
        return {"request_ids": [r.request_id for r in reqs], "lengths": list(res.lengths),
                "accepted": list(res.num_accepted),
                "conf_logit": None if res.conf_logit is None
                else self.runner.to_host(res.conf_logit.float())}

    # -- loops -------------------------------------------------------------------------------

    def run(self, reqs, *, use_tqdm=True, desc="dspark_rt") -> list[RequestOutput]:
        """Queues checked requests and steps until all finish."""
        self.add_all(reqs)
        return self.drive(reqs, use_tqdm=use_tqdm, desc=desc)

    def add_all(self, reqs):
        """Queues checked requests: all, or none if one does not fit."""
        with self._lock:
            try:
                for q in reqs:
                    self.add(q)
            except ValueError:
                for q in reqs:
                    self.abort(q.request_id)
                raise

    def drive(self, reqs, *, use_tqdm=True, desc="dspark_rt") -> list[RequestOutput]:
        """Steps until these queued requests finish (other requests advance too); on an
        interrupt nothing of them stays queued or holds pages."""
        bar = tqdm(total=sum(q.max_tokens for q in reqs), desc=desc, unit="tok",
                   disable=not use_tqdm)
        try:
            while any(not q.finished for q in reqs):
                outs = self.step()
                bar.update(sum(len(o.new_token_ids) for o in outs))
                if use_tqdm and self.runner.gamma:
                    tau = SpecMetrics.merged(q.metrics for q in reqs).mean_acceptance_length
                    bar.set_postfix(tau=f"{tau:.2f}", refresh=False)
        finally:
            bar.close()
            for q in reqs:
                if not q.finished and self.owns_caches:
                    self.abort(q.request_id)
        return [self.output(q) for q in reqs]

    def stream(self, prompt, params=None):
        """Adds one request and yields StepOutput deltas for it until it finishes (other queued
        requests advance too)."""
        return self.stream_request(self.requests[self.add_request(prompt, params)])

    def stream_request(self, req):
        """Deltas of a queued request, read from the request itself, so that several streams (or
        a run) stepping the same Engine never take each other's tokens. Closing the generator
        early aborts the request."""
        sent = 0
        try:
            while True:
                new = req.output_ids[sent:]
                if new or req.finished:
                    sent += len(new)
                    done = req.finished
                    yield StepOutput(req.request_id, list(new), done,
                                     self.output(req) if done else None, req.error)
                    if done:
                        return
                self.step()
        finally:
            if not req.finished and self.owns_caches:
                self.abort(req.request_id)
