"""/tokenize and /detokenize in vLLM's request and response shapes, through the target's
tokenizer: a completion prompt or chat messages (rendered as /v1/chat/completions renders them)
to token ids, and token ids back to text."""
from .errors import APIError, bad
from .fields import DETOKENIZE, TOKENIZE, TOKENIZE_CHAT, check_fields
from .protocol import render_chat


def _body(body) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _flag(body, name, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


def _need(tokenizer):
    if tokenizer is None:
        raise APIError(400, "this target has no tokenizer (tokenizer.json)")


def tokenize(body, tokenizer, max_model_len: int) -> dict:
    """{"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens",
    "token_strs"}. add_special_tokens (default true) is what generation uses: a chat prompt is
    encoded as the engine encodes the rendered conversation, so count equals the usage's
    prompt_tokens of the same request."""
    body = _body(body)
    chat = "messages" in body
    check_fields(body, TOKENIZE_CHAT if chat else TOKENIZE)
    _need(tokenizer)
    if chat:
        text = render_chat(body, tokenizer)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad("prompt", f"must be a string, got {type(text).__name__}")
    ids = tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", True))
    strs = [tokenizer.decode([t]) for t in ids] if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body, tokenizer) -> dict:
    """{"tokens": [ids]} -> {"prompt": text} (special tokens kept)."""
    body = _body(body)
    check_fields(body, DETOKENIZE)
    _need(tokenizer)
    ids = body.get("tokens")
    V = tokenizer.vocab_size
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V for t in ids):
        raise bad("tokens", f"must be a list of token ids in [0, {V})")
    return {"prompt": tokenizer.decode(ids)}
