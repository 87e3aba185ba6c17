"""Evaluation prompt files: JSONL with one `{"turns": ["...", ...]}` object per line.

Without `chat`, a prompt is the first turn's raw text. With `chat`, all turns of a line become
consecutive user messages rendered through the tokenizer's chat template (with the generation
prompt). Blank lines are skipped; a malformed line is a PromptFileError naming file and line.
Also here: the argument parsing the calibrate / profile / eval commands share (each argument is
checked as it is parsed, so a bad one is reported under its own name).
"""
import json
import math
import re
import logging
from pathlib import Path

from ..checkpoint.tensors import DTYPE_NAMES

log = logging.getLogger(__name__)


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file (and line)."""


def read_turns(path, limit: int | None = None) -> list[list[str]]:
    """The turns of the first `limit` prompts of a JSONL file (all when limit is None)."""
    path = Path(path)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or an int >= 1, got {limit!r}")
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file not found")
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            turns = d.get("turns") if isinstance(d, dict) else None
            if not isinstance(turns, list) or not turns or \
                    not all(isinstance(t, str) and t for t in turns):
                raise PromptFileError(f"{path}:{lineno}: expected an object with \"turns\": a "
                                      "non-empty list of non-empty strings")
            out.append(turns)
    if not out:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    return out


def load_prompts(path, tokenizer=None, *, chat: bool = False, limit: int | None = None,
                 max_prompt_tokens: int | None = None):
    """Prompts of a JSONL file for Decoder.generate.

    Without a tokenizer: a list of str (first turns; `chat` needs a tokenizer). With one: a list
    of token-id lists; a prompt longer than max_prompt_tokens keeps its last max_prompt_tokens
    tokens (the end of a prompt is what the answer follows).
    """
    turns = read_turns(path, limit)
    if chat and tokenizer is None:
        raise ValueError("chat=True needs a tokenizer (the target folder's tokenizer.json)")
    if tokenizer is None:
        return [t[0] for t in turns]
    prompts, cut = [], 0
    for t in turns:
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": c} for c in t],
                                                 add_generation_prompt=True)
        else:
            text = t[0]
        ids = tokenizer.encode(text)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            ids, cut = ids[len(ids) - max_prompt_tokens:], cut + 1
        prompts.append(ids)
    if cut:
        log.warning("%s: %d of %d prompts are longer than %d tokens and keep their last %d",
                    path, cut, len(prompts), max_prompt_tokens, max_prompt_tokens)
    return prompts


def fit_length(decoder, max_tokens: int) -> int:
    """Longest prompt (tokens) that leaves room for max_tokens new tokens and a speculative block
    inside the target's context."""
    slack = decoder.runner.gamma + 2
    room = decoder.max_model_len - max_tokens - slack
    if room < 1:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for a prompt in the target's "
                         f"context of {decoder.max_model_len} tokens")
    return room


# -- command-line arguments shared by `dspark-rt calibrate | profile | eval` -------------------

DTYPES = ["auto", *DTYPE_NAMES]  # auto: the checkpoint's half dtype on a GPU, float32 on the CPU


def model_dir(path):
    import argparse
    if not (Path(path) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{path}: not a model folder (no config.json)")
    return path


def existing_file(path):
    import argparse
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{path}: file not found")
    return path


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def byte_size(s) -> int:
    """argparse type: a positive number of bytes, with an optional unit (2GiB, 512MiB, 1.5G)."""
    import argparse
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    unit = m and m.group(2).lower().removesuffix("b")
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size in bytes (e.g. 2GiB, 512MiB, "
                                         "1000000)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {s!r}")
    return n


def positive(kind, zero_ok=False):
    """argparse type: a finite number of `kind` > 0 (>= 0 with zero_ok)."""
    import argparse

    def parse(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a valid {kind.__name__}") from None
        if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero_ok else '> 0'} and finite, "
                                             f"got {s}")
        return v
    return parse


def tool_parser(cmd: str, description: str, *, prompts: bool = True):
    """ArgumentParser with --target --drafter [--prompts --limit --max-tokens --batch-size
    --chat] --device --dtype, each checked as it is parsed."""
    import argparse
    ap = argparse.ArgumentParser(prog=f"dspark-rt {cmd}", description=description)
    ap.add_argument("--target", required=True, type=model_dir, help="target model folder")
    ap.add_argument("--drafter", required=True, type=model_dir, help="drafter folder")
    if prompts:
        ap.add_argument("--prompts", required=True, type=existing_file,
                        help='JSONL prompt file, one {"turns": [...]} per line')
        ap.add_argument("--limit", type=positive(int), help="the first N prompts only")
        ap.add_argument("--max-tokens", type=positive(int), default=128)
        ap.add_argument("--batch-size", type=positive(int), default=8,
                        help="prompts per generate() call")
        ap.add_argument("--chat", action="store_true",
                        help="all turns through the chat template (default: first turn, raw)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=DTYPES)
    return ap


def parse_tool_args(ap, argv):
    """Parses argv; settings the parser cannot see (CUDA present, dtype "auto") are checked and
    normalised here, so the tools get clean values."""
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            ap.error(f"argument --device: {args.device!r} but torch sees no CUDA device")
    elif args.device != "cpu":
        ap.error(f"argument --device: must be cpu or cuda[:N], got {args.device!r}")
    args.dtype = None if args.dtype == "auto" else args.dtype
    return args


def run_tool(ap, fn, *a, **kw):
    """Runs a tool; a bad file or setting found while running ends with one clear line (exit 2)."""
    try:
        fn(*a, **kw)
    except (ValueError, OSError) as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    return 0
