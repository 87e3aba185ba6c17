"""OpenAI response shapes: whole completions and chat completions, their server-sent-event chunks,
usage, log-probabilities, and the per-request speculative metrics in vLLM's shape
(`metrics.speculative_decoding` at the response root).

Streamed text is the incremental text of the emitted tokens, minus a hold-back of the longest
stop string's length - 1 characters while stop strings are set: a stop string that ends in a
later round can then never have been sent in part, so the streamed pieces always add up to the
final text (the Processor's, which is cut before the stop string).
"""
import json
import time
import uuid

from ..outputs import RequestOutput, SpecMetrics
from ..checkpoint.tokenizer import IncrementalText
from . import prompt_logprobs
from .stats import drafted_rounds


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def spec_metrics(m: SpecMetrics) -> dict:
    """vLLM's per-request names, counted as the Prometheus counters count: a spec step is a round
    of this request that drafted (verified at least one draft; rounds run plainly, by the
    `speculative` switch or the auto policy, are not); mean_acceptance_length counts the
    target's own token: 1 + accepted / steps (1.0 without steps). num_rounds: every round."""
    steps = drafted_rounds(m)
    return {"speculative_decoding": {
        "mean_acceptance_length": 1 + m.num_accepted_draft_tokens / steps if steps else 1.0,
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "acceptance_histogram": list(m.acceptance_histogram),
        "num_spec_steps": steps,
        "num_rounds": m.num_rounds,
        "num_accepted_draft_tokens": m.num_accepted_draft_tokens,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens_per_pos": list(m.num_accepted_tokens_per_pos),
        "num_nonfinite_drafts": m.num_nonfinite_drafts,
    }}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(out: RequestOutput) -> str:
    return "length" if out.finish_reason == "length" else "stop"


def with_grammar(choice: dict, out: RequestOutput) -> dict:
    """A finished choice of a request with structured output says whether its text is a whole
    match ("grammar_complete": false when max_tokens cut it first; the field is absent without
    a grammar)."""
    complete = out.outputs[0].grammar_complete
    if complete is not None:
        choice["grammar_complete"] = complete
    return choice


class Logprobs:
    """The OpenAI log-probability objects of emitted tokens: completions' {tokens,
    token_logprobs, top_logprobs, text_offset} and chat's {content: [{token, logprob, bytes,
    top_logprobs}]}. tops: per token its row's top N ((token id, logprob), ...), most likely
    first (SamplingParams.logprobs = N), or None (N = 0: empty top_logprobs). A completion's
    top_logprobs entry holds the sampled token too; chat's lists the top N alone (OpenAI's)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def _piece(self, t: int) -> str:
        return self.tok.decode([t]) if self.tok is not None else f"token_id:{t}"

    def completion(self, ids, logprobs, offset: int = 0, tops=None) -> dict:
        pieces = [self._piece(t) for t in ids]
        offsets, o = [], offset
        for p in pieces:
            offsets.append(o)
            o += len(p)
        # the sampled token and its row's top N, as the echoed prompt's entries (vLLM's)
        top_lps = [{} for _ in pieces] if tops is None else [
            {p: lp, **{self._piece(a): b for a, b in top}} for p, lp, top in zip(pieces, logprobs, tops)]
        return {"tokens": pieces, "token_logprobs": list(logprobs), "top_logprobs": top_lps,
                "text_offset": offsets}

    def chat(self, ids, logprobs, tops=None) -> dict:
        content = []
        tops = tops if tops is not None else [()] * len(ids)
        for t, lp, top in zip(ids, logprobs, tops):
            content.append(dict(self._entry(t, lp), top_logprobs=[self._entry(a, b) for a, b in top]))
        return {"content": content}

    def _entry(self, t: int, lp: float) -> dict:
        p = self._piece(t)
        return {"token": p, "logprob": lp, "bytes": list(p.encode("utf-8"))}


def top_of(out: RequestOutput, n: int) -> list | None:
    """Per emitted token the top n ((id, logprob), ...) of its row, from the output's
    {token id: Logprob} dicts (the sampled token and the top n), most likely first."""
    lps = out.outputs[0].logprobs
    if lps is None or n == 0:
        return None
    return [tuple((t, v.logprob) for t, v in sorted(d.items(), key=lambda kv: kv[1].rank)[:n])
            for d in lps]


class Body:
    """Builds one request's responses: the whole body, or its stream chunks. stops and
    skip_special_tokens: the request's SamplingParams fields (the stream's text is decoded as
    the engine decodes the whole text); include_stop_str: the stop string that ended the text
    stays in it; usage_every_chunk: each chunk carries the usage so far (prompt_tokens: the
    prompt's length). prompt: a server.prompt_logprobs.Prompt when the request echoes its prompt
    or asked for vLLM's prompt_logprobs field. top: the generated tokens' top alternatives
    (completions' logprobs N, chat's top_logprobs)."""

    def __init__(self, kind: str, model: str, tokenizer, want_logprobs: bool, stops,
                 skip_special_tokens: bool, *, include_stop_str: bool = False,
                 usage_every_chunk: bool = False, prompt_tokens: int = 0, prompt=None,
                 top: int = 0):
        self.kind, self.model, self.id = kind, model, new_id(kind)
        self.created = int(time.time())
        self.lp = Logprobs(tokenizer) if want_logprobs else None
        self.top = top
        self.tok, self.stops, self.skip = tokenizer, list(stops), skip_special_tokens
        self.text = IncrementalText(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.include_stop_str, self.usage_every_chunk = include_stop_str, usage_every_chunk
        self.prompt_tokens, self.num_tokens = prompt_tokens, 0
        self.sent = ""        # text streamed so far
        self.first = True
        self.prompt = prompt
        # generated text (and its logprobs' offsets) follows the echoed prompt
        self.echo = prompt.text if prompt is not None and prompt.echo else ""
        self.score_only = prompt is not None and prompt.score_only

    def final_text(self, out: RequestOutput) -> str:
        """The output's text, with the stop string that ended it when include_stop_str (the
        engine cuts the text before it): the first of the request's stop strings (in their
        order) that the whole decoded text holds where the output's text ends."""
        if not (self.include_stop_str and self.stops and out.finish_reason == "stop"
                and self.tok is not None):
            return out.text
        whole = self.tok.decode(out.token_ids, skip_special_tokens=self.skip)
        if whole.startswith(out.text):
            for s in self.stops:
                if whole.startswith(s, len(out.text)):
                    return out.text + s
        return out.text

    def _object(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _root(self, chunk: bool, choices) -> dict:
        return {"id": self.id, "object": self._object(chunk), "created": self.created,
                "model": self.model, "choices": choices}

    def _logprobs(self, ids, lps, offset, tops=None):
        if self.lp is None or lps is None:
            return None
        tops = tops if self.top else None
        if self.kind == "chat":
            return self.lp.chat(ids, lps, tops)
        return self.lp.completion(ids, lps, len(self.echo) + offset, tops)

    def _with_prompt(self, choice: dict, lp, entries, root: dict) -> None:
        """Echo's prompt part in front of the choice's logprobs, and vLLM's prompt_logprobs
        field (completions: in the choice; chat: at the root, as vLLM puts them)."""
        p = self.prompt
        if p is None:
            return
        piece = Logprobs(self.tok)._piece
        if entries is None:  # a request aborted or failed before its prefill ended
            entries = [None] * len(p.ids)
        if p.echo and self.lp is not None:
            head = prompt_logprobs.legacy(piece, p.ids, entries, p.top)
            lp = lp or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            choice["logprobs"] = {k: head[k] + lp[k] for k in head}
        if p.field is not None:
            v = prompt_logprobs.vllm(piece, p.ids, entries, p.field, p.computed)
            (root if self.kind == "chat" else choice)["prompt_logprobs"] = v

    # -- whole response ----------------------------------------------------------------------

    def full(self, out: RequestOutput) -> dict:
        ids, lps = ([], []) if self.score_only else (out.token_ids, out.logprobs)
        lp = self._logprobs(ids, lps, 0, None if self.score_only else top_of(out, self.top))
        text = self.echo + ("" if self.score_only else self.final_text(out))
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": finish_reason(out)}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp,
                      "finish_reason": finish_reason(out)}
        body = self._root(False, [with_grammar(choice, out)])
        self._with_prompt(choice, lp, out.prompt_logprobs, body)
        body["usage"] = usage(len(out.prompt_token_ids), len(ids))
        body["metrics"] = spec_metrics(out.metrics)
        return body

    # -- stream chunks -----------------------------------------------------------------------

    def _chunk(self, text: str, ids, lps, reason=None, tops=None) -> dict:
        lp = self._logprobs(ids, lps, len(self.sent), tops)
        if self.kind == "chat":
            delta = {"content": text}
            if self.first:
                delta = {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
        self.first = False
        body = self._root(True, [choice])
        if self.usage_every_chunk:
            body["usage"] = usage(self.prompt_tokens, self.num_tokens)
        return body

    def head(self, entries) -> dict | None:
        """The stream's first chunk when the request echoes its prompt or asked for vLLM's
        prompt_logprobs: the prompt's text and log-probabilities (entries: the engine's)."""
        if self.prompt is None:
            return None
        chunk = self._chunk(self.echo, [], [] if self.lp is not None else None)
        self._with_prompt(chunk["choices"][0], chunk["choices"][0]["logprobs"], entries, chunk)
        return chunk

    def delta(self, new_ids, logprobs, tops=None) -> dict | None:
        """The chunk of one step's new tokens (None when nothing is to be sent yet).
        logprobs: those tokens' log-probabilities, when asked for; tops: their rows' top
        alternatives ((id, logprob), ...) per token."""
        if self.score_only:
            return None
        ready = self.sent
        self.num_tokens += len(new_ids)
        if self.text is not None:
            for t in new_ids:
                self.text.push(t)
            ready = self.text.text[: max(len(self.sent), len(self.text.text) - self.hold)]
        piece = ready[len(self.sent):]
        if not piece and not (self.lp is not None and new_ids):
            return None
        chunk = self._chunk(piece, new_ids, logprobs, tops=tops)
        self.sent = ready
        return chunk

    def last(self, new_ids, logprobs, out: RequestOutput, tops=None) -> dict:
        """The final chunk: the rest of the final text and the finish reason."""
        text = "" if self.score_only else self.final_text(out)
        rest = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.num_tokens = 0 if self.score_only else len(out.token_ids)
        if self.score_only:
            new_ids, logprobs, tops = [], ([] if logprobs is not None else None), None
        chunk = self._chunk(rest, new_ids, logprobs, finish_reason(out), tops)
        with_grammar(chunk["choices"][0], out)
        self.sent += rest
        return chunk

    def usage_chunk(self, out: RequestOutput) -> dict:
        body = self._root(True, [])
        body["usage"] = usage(len(out.prompt_token_ids), 0 if self.score_only else len(out.token_ids))
        body["metrics"] = spec_metrics(out.metrics)
        return body


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
