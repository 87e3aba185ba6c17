"""The public entry point: Decoder.from_pretrained(target, drafter).generate(prompts, params)."""
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .models.drafter import Drafter
from .models.qwen3 import Qwen3Model
from .outputs import RequestOutput, SpecMetrics
from .policy import Calibration, FixedPolicy, make_policy
from .request import Request
from .runner import MODES, Runner
from .sampling_params import SamplingParams
from .tokenizer import IncrementalText, Tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float64": torch.float64, "fp64": torch.float64}


def _dtype(dtype, device):
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


class Decoder:
    """DSpark speculative decoding of a target model with a drafter.

    mode: "ar" (target alone), "dflash" (backbone drafts, all verified) or "dspark" (sequential
    head + confidence-scheduled verification; the default when the drafter has a head).
    policy: "fixed" | "threshold" | "sync" | "async" | a VerifyPolicy (used in "dspark" mode);
    "sync" and "async" read sps= (a measured throughput profile or its JSON path); without it
    the engine is profiled once and cached by device identity. calibration: STS temperatures
    (a Calibration, a list, or the path of a JSON written by dspark_rt.sts or SGLang).
    """

    def __init__(self, target: Qwen3Model, drafter: Drafter | None, tokenizer: Tokenizer | None, *,
                 mode=None, policy="fixed", threshold=0.5, sps=None, calibration=None,
                 page_size=16, seed=0, device="cpu"):
        self.device = torch.device(device)
        if mode is None:
            mode = "ar" if drafter is None else ("dspark" if drafter.head != "none" or drafter.conf_w is not None else "dflash")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        kwargs = {"threshold": threshold} if policy == "threshold" else {}
        # sync / async without a profile: measure one (or reuse the cached one) once the runner
        # exists, since the measurement runs real rounds.
        profile_later = policy in ("sync", "async") and sps is None and mode == "dspark"
        if policy in ("sync", "async") and not profile_later:
            kwargs = {"sps": sps}
        if profile_later or (policy in ("sync", "async") and mode != "dspark"):
            self.policy = FixedPolicy()  # set below; outside dspark mode no policy is consulted
        else:
            self.policy = make_policy(policy, **kwargs)
        if isinstance(calibration, (str, Path)):
            from .sts import read_temperatures
            calibration = read_temperatures(calibration)
        if isinstance(calibration, (list, tuple)):
            calibration = Calibration(list(calibration))
        if calibration is not None and not isinstance(calibration, Calibration):
            raise ValueError(f"calibration must be a Calibration or a list of per-position "
                             f"temperatures, got {type(calibration).__name__}")
        self.target, self.drafter, self.tokenizer, self.mode = target, drafter, tokenizer, mode
        self.runner = Runner(target, drafter, mode, self.policy, calibration, page_size, self.device)
        self._seed = seed
        self._next_id = 0
        self._engine = None  # generate and stream run on it (see _engine_for)
        # Set to a list to record every round (calibration and diagnostics read it).
        self.round_log: list[dict] | None = None
        self.max_model_len = target.config.max_position_embeddings
        if profile_later:
            if drafter is None or drafter.conf_w is None:
                raise ValueError(f"policy {policy!r} needs a drafter with a confidence head")
            from .profiling import load_or_profile
            self.policy = self.runner.policy = make_policy(policy, sps=load_or_profile(self))

    @classmethod
    def from_pretrained(cls, target, drafter=None, *, device="cpu", dtype=None, **kwargs):
        """target: a Hugging Face Qwen3 / Llama folder; drafter: a DeepSpec DSpark/DFlash or
        z-lab DFlash folder (or None for plain decoding)."""
        device = torch.device(device)
        dt = _dtype(dtype, device)
        tgt = Qwen3Model.from_pretrained(target, dtype=dt, device=device)
        drf = Drafter.from_pretrained(drafter, tgt, dtype=dt, device=device) if drafter else None
        tok = Tokenizer.from_pretrained(target) if (Path(target) / "tokenizer.json").exists() else None
        return cls(tgt, drf, tok, device=device, **kwargs)

    # -- requests ----------------------------------------------------------------------------

    def _make_request(self, i, prompt, params) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {i}: params must be a SamplingParams, got {type(params).__name__}")
        try:
            params.check()
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        V = self.target.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {i}: a text prompt needs a tokenizer.json in the target folder")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"request {i}: prompt token ids must lie in [0, {V}), got {bad[:5]}")
        else:
            raise ValueError(f"request {i}: prompt must be a str or a list of int token ids")
        if not ids:
            raise ValueError(f"request {i}: prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {i}: prompt has {len(ids)} tokens, the model's context is "
                             f"{self.max_model_len} (max_position_embeddings)")
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"request {i}: stop_token_ids must lie in [0, {V}), got {bad}")
        if params.seed is not None:
            seed, stream = params.seed, 0
        else:
            seed, stream = self._seed, self._next_id + 1
        rid = self._next_id
        self._next_id += 1
        return Request(rid, text, ids, params, seed, stream, SpecMetrics(self.runner.gamma))

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= set(self.eos_token_ids)
        return ids

    @property
    def eos_token_ids(self) -> list[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return list(self.tokenizer.eos_token_ids)
        eos = self.target.config.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def _commit(self, req: Request, tokens: list[int], logprobs: list[float] | None):
        """Appends emitted tokens, honouring stop tokens, stop strings and max_tokens."""
        stops = self._stop_ids(req.params)
        for j, t in enumerate(tokens):
            req.output_ids.append(t)
            if logprobs is not None:
                req.logprobs.append(logprobs[j])
            if t in stops:
                req.finish_reason = "stop"
            elif req.remaining <= 0 or req.kv_len + j + 2 >= self.max_model_len:
                req.finish_reason = "length"
            if req.params.stop and self.tokenizer is not None and self._stop_string(req, t):
                req.finish_reason = "stop"
            if req.finished:
                return j + 1
        return len(tokens)

    def _stop_string(self, req: Request, token: int) -> bool:
        """Feeds one emitted token to the request's incremental text; on the first stop string
        the text is cut before it. Only the newly settled text (and the stops' length before
        it) is searched: earlier text held no stop."""
        if req.detok is None:
            req.detok = IncrementalText(self.tokenizer)
        new = req.detok.push(token)
        if not new:
            return False
        text = req.detok.text
        lo = max(0, len(text) - len(new) - max(len(s) for s in req.params.stop) + 1)
        hits = [i for i in (text.find(s, lo) for s in req.params.stop) if i >= 0]
        if hits:
            req.text = text[: min(hits)]
        return bool(hits)

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompts, params=None, *, use_tqdm=True) -> list[RequestOutput]:
        """prompts: a str, a list of str, a list of token ids or a list of token-id lists.
        params: one SamplingParams for all, or one per prompt. All requests are checked before
        any work starts, so a bad request costs the others nothing."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params has {len(plist)} entries for {len(prompts)} prompts")
        reqs = [self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        if reqs:
            self._run(reqs, use_tqdm)
        return [self._output(r) for r in reqs]

    def chat(self, messages, params=None, **kwargs) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer in the target folder")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params, **kwargs)

    def stream(self, prompt, params=None, *, num_pages: int = 512):
        """Yields the request's new tokens round by round (engine.StepOutput: new_token_ids,
        finished, and the full RequestOutput on the last one). Other open streams of this
        Decoder advance in the same rounds."""
        req = self._make_request(0, prompt, params or SamplingParams())
        eng = self._engine_for([req], num_pages)
        eng._add(req)
        yield from eng._stream(req)

    def _engine_for(self, reqs: list[Request], min_pages: int = 0):
        """The Decoder's Engine, (re)built when its caches cannot hold these requests' whole
        lifetimes at once (offline batches run without preemption)."""
        from .engine import EngineConfig
        from .engine.engine import Engine
        r = self.runner
        slack = r.gamma + (self.drafter.block_size if r.mode != "ar" else 0) + 2
        need = sum(-(-(len(q.prompt_ids) + q.params.max_tokens + slack) // r.page_size) for q in reqs)
        need = max(min_pages, need + need // 50 + 1)  # + the admission watermark
        seqs, budget = len(reqs), max(8192, len(reqs) * (1 + r.gamma))
        eng = self._engine
        if eng is not None and eng.owns_caches and eng.has_unfinished():
            # Open streams share the Engine (and its pool, with preemption when short).
            seqs += len(eng.requests)
            budget = max(budget, seqs * (1 + r.gamma))
        elif eng is None or not eng.owns_caches or eng.num_pages < need:
            eng = self._engine = Engine(self, EngineConfig(num_pages=need, max_num_seqs=seqs,
                                                           max_num_batched_tokens=budget,
                                                           chunk_size=budget))
        eng.scheduler.max_num_seqs = max(eng.scheduler.max_num_seqs, seqs)
        eng.scheduler.max_num_batched_tokens = max(eng.scheduler.max_num_batched_tokens, budget)
        return eng

    def _run(self, reqs: list[Request], use_tqdm: bool):
        eng = self._engine_for(reqs)
        try:
            for q in reqs:
                eng._add(q)
        except ValueError:  # too big for the pool of open streams: queue none of the batch
            for q in reqs:
                eng.abort(q.request_id)
            raise
        bar = tqdm(total=sum(q.params.max_tokens for q in reqs), desc=f"dspark_rt {self.mode}",
                   unit="tok", disable=not use_tqdm)
        try:
            while any(not q.finished for q in reqs):
                outs = eng.step()
                bar.update(sum(len(o.new_token_ids) for o in outs))
                if use_tqdm and self.runner.gamma:
                    bar.set_postfix(tau=f"{self._tau(reqs):.2f}", refresh=False)
        finally:
            bar.close()
            for q in reqs:  # on an interrupt: nothing stays queued or holds pages
                if not q.finished and eng.owns_caches:
                    eng.abort(q.request_id)

    def _apply(self, reqs, tokens, logits, row_starts, lengths=None):
        """Commits each request's emitted tokens (x_1 .. x_a, y; its target logits start at row
        row_starts[i]); returns how many positions each committed into the KV cache (anchor +
        accepted drafts)."""
        logprobs = self._logprobs(reqs, tokens, logits, row_starts)
        committed = []
        for i, r in enumerate(reqs):
            toks = tokens[i]
            a = len(toks) - 1
            lp = logprobs.get(i)
            if lengths is not None and self.runner.gamma:
                r.metrics.record(lengths[i], a)
            self._commit(r, toks, lp)
            if r.anchor >= 0:  # a decode round: anchor and accepted drafts enter the cache
                r.kv_len += a + 1
            r.anchor = toks[-1]
            r.round += 1
            committed.append(a + 1)
        return committed

    def _logprobs(self, reqs, tokens, logits, row_starts) -> dict[int, list[float]]:
        """Raw target log-probabilities of the emitted tokens of the requests that asked, in one
        device read for the whole round: {index in reqs: [logprob per emitted token]}."""
        want = [i for i, r in enumerate(reqs) if r.params.logprobs]
        if not want:
            return {}
        rows = [row_starts[i] + k for i in want for k in range(len(tokens[i]))]
        ids = [t for i in want for t in tokens[i]]
        dev = logits.device
        picked = torch.log_softmax(logits[torch.tensor(rows, device=dev)].double(), dim=-1)
        picked = picked.gather(1, torch.tensor(ids, device=dev)[:, None])[:, 0]
        flat = self.runner.to_host(picked).tolist()
        out, o = {}, 0
        for i in want:
            out[i] = flat[o : o + len(tokens[i])]
            o += len(tokens[i])
        return out

    def _log_entry(self, reqs, res) -> dict:
        return {"request_ids": [r.request_id for r in reqs],
                "lengths": list(res.lengths),
                "accepted": list(res.num_accepted),
                "conf_logit": None if res.conf_logit is None
                else self.runner.to_host(res.conf_logit.float())}

    @staticmethod
    def _tau(reqs) -> float:
        m = SpecMetrics(reqs[0].metrics.gamma)
        for r in reqs:
            m.merge(r.metrics)
        return m.mean_acceptance_length

    def _output(self, r: Request) -> RequestOutput:
        text = r.text
        if not text and self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids)
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, text, list(r.output_ids),
                             r.finish_reason or "length",
                             list(r.logprobs) if r.params.logprobs else None, r.metrics)
