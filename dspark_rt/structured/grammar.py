"""Grammars compiled by xgrammar (the engine vLLM and SGLang use): tokenizer info from our
tokenizer.json, compiled grammars cached per (grammar, tokenizer), and the per-request matcher
the round walks (walk.py).

xgrammar over llguidance: it installs here from the registry as a CPU wheel, compiles JSON
schema, regex, EBNF and structural tags ahead of time into a token-mask cache (a mask is mostly
a copy of precomputed words), and its matcher rolls back up to max_rollback_tokens, which is
exactly the verify walk's need (any depth, in xgrammar >= 0.2).
"""
import json
import os
import re
from functools import lru_cache

import numpy as np
import torch


try:
    import xgrammar as xgr
except ImportError:  # structured output is refused, by name, where it is asked for
    xgr = None



def _require():
    if xgr is None:
        raise ValueError("structured_outputs needs the xgrammar package (pip install xgrammar)")


def engine_message(e: Exception) -> str:
    """xgrammar's own words, without its log prefix ("[time] file.cc:line: ")."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip())


def parse(spec):
    """Parses the grammar without a tokenizer (cheap): a ValueError naming the field and
    xgrammar's message, before any request work; the compile per tokenizer comes later."""
    _require()
    form, v = spec.key()
    try:
        if form == "json":
            xgr.Grammar.from_json_schema(v, any_whitespace=False)
        elif form == "regex":
            xgr.Grammar.from_regex(v)
        elif form == "grammar":
            xgr.Grammar.from_ebnf(v)
    except Exception as e:  # xgrammar raises RuntimeError with its parser's message
        raise ValueError(f"structured_outputs.{form}: {engine_message(e)}") from None


def tokenizer_info(tokenizer_dir: str, V: int, stop_ids: tuple):
    """xgrammar's view of the tokenizer.json in tokenizer_dir, padded to the model's V."""
    _require()
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = [""] * V
    for text, i in tj["model"]["vocab"].items():
        if i < V:
            vocab[i] = text
    for t in tj.get("added_tokens", []):
        if t["id"] < V:
            vocab[t["id"]] = t["content"]
    dec = json.dumps(tj.get("decoder"))
    kind = (xgr.VocabType.BYTE_LEVEL if "ByteLevel" in dec else
            xgr.VocabType.BYTE_FALLBACK if "ByteFallback" in dec else xgr.VocabType.RAW)
    return xgr.TokenizerInfo(vocab, kind, vocab_size=V, stop_token_ids=list(stop_ids))


@lru_cache(maxsize=8)
def _book(tokenizer_dir: str, V: int, stop_ids: tuple) -> "GrammarBook":
    return GrammarBook(tokenizer_info(tokenizer_dir, V, stop_ids))


def grammar_book(tokenizer, V: int) -> "GrammarBook":
    """The GrammarBook of a dspark_rt Tokenizer (tokenizer.json in tokenizer.path) for a model
    of vocabulary V: one per (tokenizer, V), shared by every engine that serves it."""
    return _book(os.path.abspath(tokenizer.path), V, tuple(tokenizer.eos_token_ids))


class GrammarBook:
    """Compiles StructuredOutputsParams (spec) against one tokenizer; cached per grammar."""

    def __init__(self, info):
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.cache: dict = {}

    def compile(self, spec):
        """The compiled grammar, or a ValueError naming the field and xgrammar's message."""
        key = spec.key()
        if key not in self.cache:
            form, v = key  # JSON without free whitespace: compact output, as json.dumps writes it
            try:
                if form == "json":
                    g = self.compiler.compile_json_schema(v, any_whitespace=False)
                elif form == "regex":
                    g = self.compiler.compile_regex(v)
                elif form == "grammar":
                    g = self.compiler.compile_grammar(v)
                else:
                    g = self.compiler.compile_regex(choice_regex(v))
            except Exception as e:  # xgrammar raises RuntimeError / ValueError with its message
                raise ValueError(f"structured_outputs.{form}: {engine_message(e)}") from None
            self.cache[key] = g
        return self.cache[key]

    def __call__(self, spec, V: int) -> "Matcher":
        return Matcher(self.compile(spec), V, self.info.stop_token_ids)


def choice_regex(choices) -> str:
    """A regex matching exactly one of the strings."""
    return "|".join("".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in s) for s in choices)


class Matcher:
    """One request's grammar state (xgrammar's GrammarMatcher) as the walk needs it."""

    def __init__(self, compiled, V: int, stop_ids=()):
        self.m = xgr.GrammarMatcher(compiled)
        self.buf = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
        self.stop_ids = [int(t) for t in stop_ids]

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole match: the grammar ended (a stop token taken), or
        it would take a stop token now (an output cut by max_tokens right at its end)."""
        if self.terminated:
            return True
        self.m.fill_next_token_bitmask(self.buf, 0)
        words = self.buf[0]
        return any(int(words[t >> 5]) >> (t & 31) & 1 for t in self.stop_ids)

    def fill(self, row: np.ndarray):
        self.m.fill_next_token_bitmask(self.buf, 0)
        row[:] = self.buf[0].numpy()

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, n: int):
        if n:
            self.m.rollback(n)
