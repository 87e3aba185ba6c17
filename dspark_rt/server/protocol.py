"""OpenAI request bodies in, checked: the prompt (text, token ids or chat messages rendered by the
target's chat template), SamplingParams and the server's options; or an APIError naming the
field, with the status and the OpenAI error JSON it answers with.

Every field is first looked up in its endpoint's table (fields.py): unknown fields, and known
ones at a value this server cannot honour, are refused by name, so that no request silently
gets something other than what it asked for.
"""
import re
from dataclasses import dataclass

from ..checkpoint.config import CheckpointError
from ..checkpoint.tokenizer import ChatTemplateError
from ..sampling_params import SamplingParams
from ..structured.request import FieldError, from_request
from .errors import APIError, bad
from .fields import CHAT, COMPLETION, MESSAGE, STREAM_OPTIONS, check_fields

__all__ = ["APIError", "GenRequest", "bad", "parse_chat", "parse_completion"]


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
    include_stop_str: bool = False     # the stop string that ended the text stays in it
    continuous_usage: bool = False     # every stream chunk carries the usage so far
    echo: bool = False                 # completions: the prompt's text (and logprobs) first
    score_only: bool = False           # max_tokens 0 with echo: the prompt alone, nothing emitted
    top_logprobs: int = 0              # logprobs N (completions) / top_logprobs (chat): the
                                       # tokens' top alternatives (with echo, the prompt's too)
    prompt_logprobs: int | None = None  # the vLLM field: N, or None when not asked


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


MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)


def _max_tokens(body, lo: int = 1):
    # both given: max_completion_tokens wins (vLLM's order; OpenAI deprecated max_tokens)
    max_tokens = _int(body, "max_tokens", None, lo=lo)
    return _int(body, "max_completion_tokens", max_tokens, lo=lo)


def _top(body, name):
    """A count of top alternatives: None or an int in [0, MAX_LOGPROBS]."""
    v = _int(body, name, None, lo=0)
    if v is not None and v > MAX_LOGPROBS:
        raise bad(name, f"must be at most {MAX_LOGPROBS} (top alternatives per token), got {v}")
    return v


def _ids(body, name):
    v = body.get(name)
    if v is not None and (not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v)):
        raise bad(name, f"must be a list of non-negative integers, got {v!r}")
    return v


def _words(body):
    v = body.get("bad_words")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
        raise bad("bad_words", f"must be a list of strings, got {v!r}")
    return v


def _sampling(body, max_tokens_default, logprobs, prompt_logprobs=None,
              max_tokens=None) -> SamplingParams:
    """logprobs: None (not asked) or N, the top alternatives of each generated token."""
    if max_tokens is None:
        max_tokens = _max_tokens(body)
    stop_ids = _ids(body, "stop_token_ids") or []
    top_k = _int(body, "top_k", 0)
    try:
        structured = from_request(body)
    except FieldError as e:  # names the field; a bad grammar carries the grammar engine's message
        raise bad(e.field, str(e).removeprefix(f"{e.field}: ")) from None
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
            top_k=top_k, seed=_int(body, "seed"),
            max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
            stop=_stop(body), stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos", False),
            logprobs=logprobs, speculative=_bool(body, "speculative", True),
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
            prompt_logprobs=prompt_logprobs, min_p=_number(body, "min_p", 0.0),
            min_tokens=_int(body, "min_tokens", 0, lo=0),
            allowed_token_ids=_ids(body, "allowed_token_ids"), bad_words=_words(body),
            structured_outputs=structured)
    except ValueError as e:  # SamplingParams names the field: report it under the API's name
        m = _PARAM.search(str(e))
        field = m.group(1) if m else "request"
        raise bad(field, str(e).replace("SamplingParams.", "")) from None


def _stream(body) -> tuple[bool, bool, bool]:
    """stream, include_usage, continuous_usage_stats."""
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad("stream_options", f"must be an object, got {opts!r}")
    check_fields(opts, STREAM_OPTIONS, "stream_options.")
    return stream, _bool(opts, "include_usage", False), _bool(opts, "continuous_usage_stats", False)


def _options(body, stream) -> dict:
    return dict(include_stop_str=_bool(body, "include_stop_str_in_output", False),
                continuous_usage=stream[2])


def _model(body, default: str) -> str:
    m = body.get("model", default)
    if m is None:
        return default
    if not isinstance(m, str):
        raise bad("model", f"must be a string, got {m!r}")
    return m


# -- the two endpoints -----------------------------------------------------------------------

def prompt_of(body):
    """A completion's prompt: a string or token ids (a batch of one is unwrapped)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"only one prompt per request is supported, got {len(prompt)}")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt))):
        raise bad("prompt", "must be a string or a list of token ids")
    return prompt


def parse_completion(body, *, default_model: str) -> GenRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_fields(body, COMPLETION)
    prompt = prompt_of(body)
    echo = _bool(body, "echo", False)
    lp = _top(body, "logprobs")  # N: each token's log-probability and its row's top N
    # max_tokens 0 with echo scores the prompt (lm-eval's log-likelihood requests): one token
    # is decoded (the prefill samples it anyway) and left out of the response
    max_tokens = _max_tokens(body, lo=0)
    if max_tokens == 0 and not echo:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        raise bad(name, "0 is served with echo only (the prompt's log-probabilities, nothing "
                  "generated)")
    prompt_lp = _top(body, "prompt_logprobs")
    # the engine computes the prompt's top alternatives once, for the larger of the two asks
    want = [n for n in (prompt_lp, lp if echo else None) if n is not None]
    stream = _stream(body)
    params = _sampling(body, 16, lp, max(want) if want else None,
                       1 if max_tokens == 0 else max_tokens)
    return GenRequest("completion", _model(body, default_model), prompt, params, stream[0],
                      stream[1], lp is not None, "prompt", **_options(body, stream), echo=echo,
                      score_only=max_tokens == 0, top_logprobs=lp or 0,
                      prompt_logprobs=prompt_lp)


def _message(i, m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad("messages", f"message {i} must be an object with a string role")
    check_fields(m, MESSAGE, f"messages[{i}].")
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
    out = {"role": m["role"], "content": content}
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise bad("messages", f"message {i}: name must be a string")
        out["name"] = m["name"]
    return out


# apply_chat_template's own arguments and the variables it sets: not a request's to override
_RESERVED = {"messages", "add_generation_prompt", "tokenize", "bos_token", "eos_token",
             "pad_token"}


def _template_kwargs(body) -> dict:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise bad("chat_template_kwargs", f"must be an object of template variables, got {kw!r}")
    taken = sorted(set(kw) & _RESERVED)
    if taken:
        raise bad("chat_template_kwargs", f"{taken[0]!r} is set by the server, not the request"
                  + (" (use the add_generation_prompt field)" if taken[0] == "add_generation_prompt"
                     else ""))
    return kw


def render_chat(body, tokenizer) -> str:
    """The conversation as the target's chat template renders it: messages, add_generation_prompt
    (default true) and chat_template_kwargs (template variables: enable_thinking, ...)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages")
    msgs = [_message(i, m) for i, m in enumerate(msgs)]
    add = _bool(body, "add_generation_prompt", True)
    kwargs = _template_kwargs(body)
    if tokenizer is None:
        raise bad("messages", "chat needs a tokenizer and chat template in the target folder")
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add, **kwargs)
    except ChatTemplateError as e:  # a template may raise on roles it does not know
        # its own words only: the message names the template's file on this machine
        raise bad("messages", f"the chat template refused them: {e.detail}") from None
    except CheckpointError:  # no template (the message names the folder)
        raise bad("messages", "chat needs a chat template in the target folder") from None


def parse_chat(body, *, default_model: str, tokenizer, max_model_len: int) -> GenRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_fields(body, CHAT)
    logprobs = _bool(body, "logprobs", False)
    top = _top(body, "top_logprobs")
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs = true")
    prompt = render_chat(body, tokenizer)
    prompt_lp = _top(body, "prompt_logprobs")
    stream = _stream(body)
    # without max_tokens a chat answer runs to a stop token or the end of the context
    return GenRequest("chat", _model(body, default_model), prompt,
                      _sampling(body, max_model_len, (top or 0) if logprobs else None, prompt_lp),
                      stream[0], stream[1], logprobs, "messages", **_options(body, stream),
                      top_logprobs=top or 0, prompt_logprobs=prompt_lp)
