"""Tokenizer of a Hugging Face model directory: tokenizer.json + the Jinja chat template.

Special tokens come from tokenizer_config.json; extra stop ids from config.json and
generation_config.json. The chat template is rendered in a sandboxed Jinja environment set up the
way transformers sets it up (trim_blocks, lstrip_blocks, loop controls, raise_exception, tojson).
"""
import json
import os
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .config import CheckpointError, read_json

__all__ = ["Tokenizer", "ChatTemplateError", "IncrementalText"]


class ChatTemplateError(ValueError):
    """The template called raise_exception(...) or failed to render. detail: the template's own
    words, without the file it came from (what a server may show its clients)."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = message if detail is None else detail


# Rendering work is bounded: a template (or the messages it is given) must not hang the process
# or fill its memory. range() elements over one render, and the size of a product or power.
_MAX_RANGE_TOTAL = 1_000_000
_MAX_BINOP_SIZE = 10_000_000
_MAX_OUTPUT_CHARS = 50_000_000


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with range() counted against a per-render budget and `*` / `**`
    refused when their result would be huge."""
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
            if abs(right) > 64 and abs(left) > 1:
                raise ChatTemplateError(f"exponent {right!r} is too large")
        if operator == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > _MAX_BINOP_SIZE:
                    raise ChatTemplateError(f"a sequence of {len(a)} * {b} items is too large")
        return super().call_binop(context, operator, left, right)


class _RangeBudget:
    def __init__(self, limit: int):
        self.left = limit

    def __call__(self, *args):
        r = range(*args)
        self.left -= len(r)
        if self.left < 0:
            raise ChatTemplateError(f"the template iterates over more than {_MAX_RANGE_TOTAL} "
                                    "range() elements")
        return r


def _token_text(v):
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class Tokenizer:
    def __init__(self, path: str):
        """path: a model directory holding tokenizer.json (and usually tokenizer_config.json)."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise CheckpointError(f"{tj}: file not found (only tokenizers in the tokenizer.json "
                                  "format are supported)")
        self.path = path
        try:
            self._tok = _HFTokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt file
            raise CheckpointError(f"{tj}: not a valid tokenizer.json ({e})") from None
        tc_path = os.path.join(path, "tokenizer_config.json")
        tc = read_json(tc_path) if os.path.isfile(tc_path) else {}
        self.bos_token = _token_text(tc.get("bos_token"))
        self.eos_token = _token_text(tc.get("eos_token"))
        self.pad_token = _token_text(tc.get("pad_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        # stop ids: the tokenizer's eos first, then those of config.json / generation_config.json
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        for name in ("config.json", "generation_config.json"):
            p = os.path.join(path, name)
            if os.path.isfile(p):
                cfg = read_json(p)
                e = cfg.get("eos_token_id")
                stops += e if isinstance(e, list) else [e] if isinstance(e, int) else []
                if self.bos_token_id is None and isinstance(cfg.get("bos_token_id"), int):
                    self.bos_token_id = cfg["bos_token_id"]
                if self.eos_token_id is None and stops:
                    self.eos_token_id = stops[0]
        self.eos_token_ids = tuple(dict.fromkeys(stops))
        self.chat_template = self._load_template(tc, path)

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        return cls(path)

    @staticmethod
    def _load_template(tc, path):
        t = tc.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
            t = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if t is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                t = f.read()
        return t

    def _template_source(self) -> str:
        tc = os.path.join(self.path, "tokenizer_config.json")
        if os.path.isfile(tc) and "chat_template" in read_json(tc):
            return tc
        return os.path.join(self.path, "chat_template.jinja")

    def _id(self, token):
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str):
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs):
        """Renders messages ([{"role", "content"}, ...]) with the model's template; returns the
        text, or its token ids when tokenize=True (no extra special tokens: the template has
        them). Extra keyword arguments become template variables (tools, enable_thinking...)."""
        if not self.chat_template:
            raise CheckpointError(f"{self.path}: no chat template (tokenizer_config.json "
                                  "'chat_template' or chat_template.jinja)")
        where = self._template_source()
        env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                  extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals["range"] = _RangeBudget(_MAX_RANGE_TOTAL)
        try:
            parts, size = [], 0
            for chunk in env.from_string(self.chat_template).generate(
                    messages=messages, add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                    pad_token=self.pad_token or "", **kwargs):
                size += len(chunk)
                if size > _MAX_OUTPUT_CHARS:
                    raise ChatTemplateError(f"the rendered text exceeds {_MAX_OUTPUT_CHARS} characters")
                parts.append(chunk)
            text = "".join(parts)
        except (ChatTemplateError, jinja2.TemplateError) as e:
            raise ChatTemplateError(f"chat template of {where}: {e}", str(e)) from None
        except Exception as e:  # noqa: BLE001 - a template runs arbitrary expressions on the messages
            why = f"failed to render: {type(e).__name__}: {e}"
            raise ChatTemplateError(f"chat template of {where} {why}", why) from None
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalText:
    """The text of a growing list of token ids at a cost independent of its length: each push
    decodes a window from the last settled boundary. Text is released once it is settled: a
    token that ends inside a multi-byte character (decoded as U+FFFD) waits for the rest."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of the ids already turned into text
        self.text = ""

    def push(self, token_id: int) -> str:
        """Appends one token; returns the text it settled (possibly empty)."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self.text += new
        self._prefix, self._read = self._read, len(self._ids)
        return new
