"""The engine's edges: a prompt and SamplingParams in, checked, as a Request; committed tokens
out, cut at stop tokens, stop strings, max_tokens and the context, with their log-probabilities,
speculative metrics and the RequestOutput. Owner of the Request's output fields (see request.py).
"""
import numbers
from typing import NamedTuple

import torch

from ..outputs import CompletionOutput, Logprob, RequestOutput, SpecMetrics
from ..sampling_params import SamplingParams
from ..checkpoint.tokenizer import IncrementalText
from .request import Request


class TokenLogprobs(NamedTuple):
    """One emitted token under the target: its log-probability, its rank in its row (vLLM's:
    the tokens at least as likely, itself included) and the row's top alternatives."""
    logprob: float
    rank: int
    top: tuple  # ((token id, logprob), ...), most likely first


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
                             f"{self.max_model_len} (max_model_len, at most the target's "
                             "max_position_embeddings)")
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"request {i}: stop_token_ids must lie in [0, {V}), got {bad}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {i}: SamplingParams.stop needs the target's tokenizer "
                             "(tokenizer.json), which this model lacks; use stop_token_ids")
        if params.seed is not None:
            seed, stream = params.seed, 0
        # the context caps the output, so the KV memory a request reserves is bounded by it
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(request_id, text, ids, params, seed, stream, SpecMetrics(self.gamma), max_tokens)

    # -- out ---------------------------------------------------------------------------------

    def commit(self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None,
               verified: int | None = None, nonfinite: bool = False):
        """Appends a round's emitted tokens (x_1 .. x_a, y), honouring stop tokens, stop
        strings, max_tokens and the context; records the round's metrics (verified: drafts
        verified, None for round 0; nonfinite: rejected at a draft whose q was NaN / inf)."""
        stops = set(req.params.stop_token_ids)
        eos = set() if req.params.ignore_eos else set(self.eos_token_ids)
        emitted = 0
        for j, t in enumerate(tokens):
            emitted += 1
            req.output_ids.append(t)
            if logprobs is not None:
                req.logprobs.append(logprobs[j].logprob)
                req.logprob_ranks.append(logprobs[j].rank)
                req.top_logprobs.append(logprobs[j].top)
            if t in stops:  # vLLM: stop_reason names a stop_token_ids entry, never the eos
                req.finish_reason, req.stop_reason = "stop", t
            elif t in eos:
                req.finish_reason = "stop"
            elif req.remaining <= 0 or req.kv_len + j + 2 >= self.max_model_len:
                req.finish_reason = "length"
            if req.params.stop and self.tokenizer is not None:
                hit = self._stop_string(req, t)
                if hit is not None:
                    req.finish_reason, req.stop_reason = "stop", hit
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

    def _stop_string(self, req: Request, token: int) -> str | None:
        """Feeds one emitted token to the request's incremental text; on the first stop string
        the text is cut before it, and that string is returned. Only the newly settled text
        (and the stops' length before it) is searched: earlier text held no stop."""
        if req.detok is None:
            req.detok = IncrementalText(self.tokenizer, req.params.skip_special_tokens)
        new = req.detok.push(token)
        if not new:
            return None
        text = req.detok.text
        lo = max(0, len(text) - len(new) - max(len(s) for s in req.params.stop) + 1)
        hits = [(i, s) for i, s in ((text.find(s, lo), s) for s in req.params.stop) if i >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        req.text = text[:at]
        return stop

    def logprobs(self, reqs, tokens, logits, row_starts, to_host) -> dict[int, list[TokenLogprobs]]:
        """The target's raw log-probabilities of the emitted tokens of the requests that asked,
        their ranks and their rows' top alternatives, in one device read (to_host) for the whole
        round: {index in reqs: [TokenLogprobs per token]}. Row k of a request's verify chain is
        the target's distribution of its k-th emitted token (row_starts[i] + k)."""
        want = [i for i, r in enumerate(reqs) if r.params.num_logprobs is not None]
        if not want:
            return {}
        rows = [row_starts[i] + k for i in want for k in range(len(tokens[i]))]
        ids = [t for i in want for t in tokens[i]]
        dev = logits.device
        lsm = torch.log_softmax(logits[torch.tensor(rows, device=dev)].double(), dim=-1)  # [n, V]
        picked = lsm.gather(1, torch.tensor(ids, device=dev)[:, None])  # [n, 1]
        cols = [picked, (lsm >= picked).sum(1, keepdim=True).double()]
        N = min(max(reqs[i].params.num_logprobs for i in want), lsm.shape[1])
        if N:
            top = lsm.topk(N, dim=-1)
            cols += [top.values, top.indices.double()]  # ids < 2**53: exact in float64
        flat = to_host(torch.cat(cols, 1)).tolist()
        out, o = {}, 0
        for i in want:
            n_top = min(reqs[i].params.num_logprobs, N)
            out[i] = [TokenLogprobs(row[0], int(row[1]),
                                    tuple(zip(map(int, row[2 + N : 2 + N + n_top]), row[2 : 2 + n_top])))
                      for row in flat[o : o + len(tokens[i])]]
            o += len(tokens[i])
        return out

    def output(self, r: Request) -> RequestOutput:
        text = r.text
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode(
                r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        asked = r.params.num_logprobs is not None
        done = r.finish_reason is not None
        completion = CompletionOutput(0, text, list(r.output_ids),
                                      sum(r.logprobs) if asked else None,
                                      self._logprob_dicts(r) if asked else None,
                                      r.finish_reason, r.stop_reason if done else None,
                                      r.grammar_complete)
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, [completion], done, r.metrics,
                             r.error, r.prompt_logprobs)

    def _logprob_dicts(self, r: Request) -> list[dict[int, Logprob]]:
        """vLLM's per-token {token id: Logprob}: the sampled token, then the top alternatives
        (ranks 1..N; a sampled token among them keeps the entry of its place there)."""
        piece = (lambda t: None) if self.tokenizer is None else (lambda t: self.tokenizer.decode([t]))
        out = []
        for t, lp, rank, top in zip(r.output_ids, r.logprobs, r.logprob_ranks, r.top_logprobs):
            d = {t: Logprob(lp, rank, piece(t))}
            for k, (tid, v) in enumerate(top, 1):
                d[tid] = Logprob(v, k, piece(tid))
            out.append(d)
        return out
