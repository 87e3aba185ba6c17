"""The engine's edges: a prompt and SamplingParams in, checked, as a Request; committed tokens
out, cut at stop tokens, stop strings, max_tokens and the context, with their log-probabilities,
speculative metrics and the RequestOutput. Owner of the Request's output fields (see request.py).
"""
import numbers

import torch

from ..outputs import RequestOutput, SpecMetrics
from ..sampling_params import SamplingParams
from ..checkpoint.tokenizer import IncrementalText
from .request import Request


class Processor:
    """tokenizer: a dspark_rt.checkpoint.tokenizer.Tokenizer or None (token-id prompts only); vocab_size,
    max_model_len and eos_token_ids: the target's; gamma: drafts per round (metrics)."""

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, eos_token_ids,
                 gamma: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.eos_token_ids, self.gamma = list(eos_token_ids), gamma

    # -- in ----------------------------------------------------------------------------------

    def request(self, i, prompt, params, request_id: int, seed: int, stream: int) -> Request:
        """A checked Request (errors name request i and the argument). seed, stream: the Philox
        key when params has no seed of its own."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {i}: params must be a SamplingParams, got {type(params).__name__}")
        try:
            params.check()
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        V = self.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {i}: a text prompt needs a tokenizer.json in the target folder")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"request {i}: prompt is not valid Unicode ({e.reason} at "
                                 f"index {e.start})") from None
            text, ids = prompt, self.tokenizer.encode(prompt)
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"request {i}: the tokenizer gave prompt token ids outside the "
                                 f"model's vocabulary [0, {V}): {bad[:5]}")
        elif isinstance(prompt, (list, tuple)) and all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"request {i}: prompt token ids must lie in [0, {V}), got {bad[:5]}")
        else:
            raise ValueError(f"request {i}: prompt must be a str or a list of int token ids, got "
                             f"{type(prompt).__name__}")
        if not ids:
            raise ValueError(f"request {i}: prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {i}: prompt has {len(ids)} tokens, the model's context is "
                             f"{self.max_model_len} (max_position_embeddings)")
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"request {i}: stop_token_ids must lie in [0, {V}), got {bad}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {i}: SamplingParams.stop needs the target's tokenizer "
                             "(tokenizer.json), which this model lacks; use stop_token_ids")
        if params.seed is not None:
            seed, stream = params.seed, 0
        # the context caps the output, so the KV memory a request reserves is bounded by it
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        return Request(request_id, text, ids, params, seed, stream, SpecMetrics(self.gamma), max_tokens)

    # -- out ---------------------------------------------------------------------------------

    def commit(self, req: Request, tokens: list[int], logprobs: list[float] | None,
               verified: int | None = None, nonfinite: bool = False):
        """Appends a round's emitted tokens (x_1 .. x_a, y), honouring stop tokens, stop
        strings, max_tokens and the context; records the round's metrics (verified: drafts
        verified, None for round 0; nonfinite: rejected at a draft whose q was NaN / inf)."""
        stops = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stops |= set(self.eos_token_ids)
        emitted = 0
        for j, t in enumerate(tokens):
            emitted += 1
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
                break
        if verified is not None and self.gamma and emitted:
            # a round cut by a stop emitted only some of its tokens: they count as accepted
            # drafts and the round's own token, so the metrics imply exactly the tokens emitted
            req.metrics.record(verified if emitted == len(tokens) else emitted - 1, emitted - 1,
                               nonfinite and emitted == len(tokens))
        req.round += 1

    @staticmethod
    def abort(req: Request):
        req.finish_reason = "abort"

    @staticmethod
    def fail(req: Request, why: str):
        """The request ends with finish_reason "error" and the reason."""
        req.finish_reason, req.error = "error", why

    def _stop_string(self, req: Request, token: int) -> bool:
        """Feeds one emitted token to the request's incremental text; on the first stop string
        the text is cut before it. Only the newly settled text (and the stops' length before
        it) is searched: earlier text held no stop."""
        if req.detok is None:
            req.detok = IncrementalText(self.tokenizer, req.params.skip_special_tokens)
        new = req.detok.push(token)
        if not new:
            return False
        text = req.detok.text
        lo = max(0, len(text) - len(new) - max(len(s) for s in req.params.stop) + 1)
        hits = [i for i in (text.find(s, lo) for s in req.params.stop) if i >= 0]
        if hits:
            req.text = text[: min(hits)]
        return bool(hits)

    def logprobs(self, reqs, tokens, logits, row_starts, to_host) -> dict[int, list[float]]:
        """Raw target log-probabilities of the emitted tokens of the requests that asked, in one
        device read (to_host) for the whole round: {index in reqs: [logprob per token]}."""
        want = [i for i, r in enumerate(reqs) if r.params.logprobs]
        if not want:
            return {}
        rows = [row_starts[i] + k for i in want for k in range(len(tokens[i]))]
        ids = [t for i in want for t in tokens[i]]
        dev = logits.device
        picked = torch.log_softmax(logits[torch.tensor(rows, device=dev)].double(), dim=-1)
        picked = picked.gather(1, torch.tensor(ids, device=dev)[:, None])[:, 0]
        flat = to_host(picked).tolist()
        out, o = {}, 0
        for i in want:
            out[i] = flat[o : o + len(tokens[i])]
            o += len(tokens[i])
        return out

    def output(self, r: Request) -> RequestOutput:
        text = r.text
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode(
                r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, text, list(r.output_ids),
                             r.finish_reason or "length",
                             list(r.logprobs) if r.params.logprobs else None, r.metrics, r.error,
                             r.prompt_logprobs)
