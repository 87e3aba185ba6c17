"""OpenAI request bodies in, checked: the prompt (text, token ids or chat messages rendered by the
target's chat template), SamplingParams and the server's options; or an APIError naming the
field, with the status and the OpenAI error JSON it answers with.

Unknown fields are ignored (clients send `user`, `metadata`, ...); known fields this server
cannot honour are refused unless they hold their neutral value, so that no request silently
gets something other than what it asked for.
"""
import re
from dataclasses import dataclass

from ..checkpoint.config import CheckpointError
from ..checkpoint.tokenizer import ChatTemplateError
from ..sampling_params import SamplingParams


class APIError(Exception):
    """status: 400 (bad field), 404 (unknown model or route), 405, 413 (body too large),
    503 (queue full, engine down), 500 (engine failure)."""

    TYPES = {404: "not_found_error", 503: "server_overloaded"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.type = type_

    def body(self) -> dict:
        default = "invalid_request_error" if self.status < 500 else "server_error"
        kind = self.type or self.TYPES.get(self.status, default)
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.status}}


def bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param)


@dataclass
class GenRequest:
    """What a completion or chat request asks for, checked."""
    kind: str                     # "completion" | "chat"
    model: str
    prompt: str | list[int]       # chat: the rendered conversation
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    prompt_field: str             # "prompt" | "messages": what a bad prompt is reported as


# -- field readers ---------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body, name, default=None, *, lo=None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or (lo is not None and v < lo):
        raise bad(name, f"must be an integer{'' if lo is None else f' >= {lo}'}, got {v!r}")
    return v


def _number(body, name, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"must be a number, got {v!r}")
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        raise bad(name, f"must be a number within float range, got an integer of "
                  f"{v.bit_length()} bits") from None


def _bool(body, name, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


def _neutral(body, name, neutral, why="is not supported"):
    """A known field this server cannot honour: accepted only at its neutral value."""
    v = body.get(name)
    if v is not None and v != neutral and not (isinstance(neutral, tuple) and v in neutral):
        raise bad(name, f"{why} (got {v!r})")


def _stop(body):
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad("stop", f"must be a non-empty string or a list of them, got {v!r}")
    return v


_PARAM = re.compile(r"SamplingParams\.(\w+)")


def _sampling(body, max_tokens_default, logprobs: bool) -> SamplingParams:
    n = _int(body, "n", 1)
    if n != 1:
        raise bad("n", f"only n = 1 is supported, got {n}")
    _neutral(body, "best_of", 1, "only best_of = 1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        _neutral(body, name, (0, 0.0), "penalties are not supported (0 only)")
    _neutral(body, "repetition_penalty", (1, 1.0), "penalties are not supported (1 only)")
    _neutral(body, "logit_bias", {}, "logit_bias is not supported")
    max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    max_tokens = _int(body, "max_tokens", max_tokens, lo=1)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad("stop_token_ids", f"must be a list of non-negative integers, got {stop_ids!r}")
    top_k = _int(body, "top_k", 0)
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
            top_k=top_k, seed=_int(body, "seed"),
            max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
            stop=_stop(body), stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos", False),
            logprobs=logprobs, speculative=_bool(body, "speculative", True))
    except ValueError as e:  # SamplingParams names the field: report it under the API's name
        m = _PARAM.search(str(e))
        field = m.group(1) if m else "request"
        raise bad(field, str(e).replace("SamplingParams.", "")) from None


def _stream(body):
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad("stream_options", f"must be an object, got {opts!r}")
    return stream, _bool(opts, "include_usage", False)


def _model(body, default: str) -> str:
    m = body.get("model", default)
    if m is None:
        return default
    if not isinstance(m, str):
        raise bad("model", f"must be a string, got {m!r}")
    return m


# -- the two endpoints -----------------------------------------------------------------------

def parse_completion(body, *, default_model: str) -> GenRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"only one prompt per request is supported, got {len(prompt)}")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt))):
        raise bad("prompt", "must be a string or a list of token ids")
    _neutral(body, "echo", False, "echo is not supported")
    _neutral(body, "suffix", "", "suffix is not supported")
    lp = body.get("logprobs")
    if lp is not None and (not _is_int(lp) or lp < 0):
        raise bad("logprobs", f"must be an integer >= 0, got {lp!r}")
    if lp:
        raise bad("logprobs", f"only logprobs = 0 (the sampled token's log-probability) is "
                  f"supported; top alternatives are not, got {lp}")
    stream, usage = _stream(body)
    want = lp is not None
    return GenRequest("completion", _model(body, default_model), prompt,
                      _sampling(body, 16, want), stream, usage, want, "prompt")


def _message_text(i, m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad("messages", f"message {i} must be an object with a string role")
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad("messages", f"message {i}: only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad("messages", f"message {i}: content must be a string or a list of text parts")
    return {"role": m["role"], "content": content}


def parse_chat(body, *, default_model: str, tokenizer, max_model_len: int) -> GenRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages")
    msgs = [_message_text(i, m) for i, m in enumerate(msgs)]
    if body.get("tools"):
        raise bad("tools", "tool calling is not supported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", "only {\"type\": \"text\"} is supported")
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs = true")
    if top:
        raise bad("top_logprobs", f"only 0 is supported (the sampled token's log-probability); "
                  f"got {top}")
    if tokenizer is None:
        raise bad("messages", "chat needs a tokenizer and chat template in the target folder")
    try:
        prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    except ChatTemplateError as e:  # a template may raise on roles it does not know
        # its own words only: the message names the template's file on this machine
        raise bad("messages", f"the chat template refused them: {e.detail}") from None
    except CheckpointError:  # no template (the message names the folder)
        raise bad("messages", "chat needs a chat template in the target folder") from None
    stream, usage = _stream(body)
    # without max_tokens a chat answer runs to a stop token or the end of the context
    return GenRequest("chat", _model(body, default_model), prompt,
                      _sampling(body, max_model_len, logprobs), stream, usage, logprobs,
                      "messages")
