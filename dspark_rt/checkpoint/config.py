"""Target model configurations parsed from Hugging Face `config.json` files (DESIGN §3), and the
field readers the drafter configurations share (drafter_config.py).

Every problem is a CheckpointError whose message names the file and the field, raised before any
weight is read.
"""
import json
import math
import os
from dataclasses import dataclass

__all__ = ["CheckpointError", "TargetConfig", "read_json"]

HEAD_TYPES = ("vanilla", "gated", "rnn")  # markov_head_type values; "none" means markov_rank 0
ROPE_TYPES = ("default", "linear", "llama3")
_ARCHS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}
_REQUIRED = object()
# far past any model (the largest have a few hundred layers); loaders build per-layer lists
MAX_LAYERS = 1 << 14


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file and field/tensor."""


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not readable JSON (nested deeper than the interpreter's "
                              "recursion limit)") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return out


def _config_path(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def architectures(d, src) -> list[str]:
    """The config's `architectures` labels (absent: none)."""
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{src}: field 'architectures' must be a list of strings, got {archs!r}")
    return archs


def _get(d, key, src, kind, default=_REQUIRED, *, min_value=None, max_value=None):
    if key not in d or d[key] is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{src}: required field '{key}' is missing")
        return default
    v = d[key]
    ok = {int: isinstance(v, int) and not isinstance(v, bool),
          float: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: isinstance(v, bool)}[kind]
    if not ok:
        raise CheckpointError(f"{src}: field '{key}' must be {kind.__name__}, got {v!r}")
    if kind is float:  # JSON's NaN / Infinity, or an int beyond float range
        v = float(v) if isinstance(v, float) or abs(v) < 2 ** 1023 else math.inf
        if not math.isfinite(v):
            raise CheckpointError(f"{src}: field '{key}' must be a finite number, got {d[key]!r}")
    if min_value is not None and v < min_value:
        raise CheckpointError(f"{src}: field '{key}' must be >= {min_value}, got {v!r}")
    if max_value is not None and v > max_value:
        raise CheckpointError(f"{src}: field '{key}' must be <= {max_value}, got {v!r}")
    return kind(v)


def _token_ids(v, src, key):
    if v is None:
        return None
    ids = v if isinstance(v, list) else [v]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{src}: field '{key}' must be a token id or a list of them, got {v!r}")
    return v


def _parse_rope(d, src, drafter=False):
    """Returns (rope_theta, rope_scaling) with rope_scaling None for plain RoPE. Drafter layers
    also take YaRN (the drafter builds its own rotary, models/drafter.py)."""
    theta = d.get("rope_theta")
    scaling = d.get("rope_scaling")
    params = d.get("rope_parameters")  # transformers >= 5 writes everything here
    if isinstance(params, dict) and params:
        if any(isinstance(v, dict) for v in params.values()):
            raise CheckpointError(f"{src}: field 'rope_parameters' is nested per layer type, "
                                  "which is not supported")
        theta = params.get("rope_theta", theta)
        scaling = scaling or params
    theta = _get({"rope_theta": theta}, "rope_theta", src, float, 10000.0)
    if theta <= 0:
        raise CheckpointError(f"{src}: field 'rope_theta' must be > 0, got {theta}")
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{src}: field 'rope_scaling' must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    allowed = ROPE_TYPES + (("yarn",) if drafter else ())
    if kind not in allowed:
        raise CheckpointError(f"{src}: rope_scaling type {kind!r} is not supported "
                              f"(supported: {', '.join(allowed)})")
    if _get(scaling, "partial_rotary_factor", src, float, 1.0) != 1.0:
        raise CheckpointError(f"{src}: field 'partial_rotary_factor' != 1 is not supported")
    if kind == "default":
        return theta, None
    out = {"rope_type": kind, "factor": _get(scaling, "factor", src, float, min_value=1e-9)}
    if kind == "yarn":  # fields and defaults of transformers' _compute_yarn_parameters
        out["original_max_position_embeddings"] = _get(
            scaling, "original_max_position_embeddings", src, int, min_value=1)
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0), ("attention_factor", None),
                             ("mscale", None), ("mscale_all_dim", None)):
            out[key] = _get(scaling, key, src, float, default)
        out["truncate"] = _get(scaling, "truncate", src, bool, True)
    if kind == "llama3":
        out["low_freq_factor"] = _get(scaling, "low_freq_factor", src, float)
        out["high_freq_factor"] = _get(scaling, "high_freq_factor", src, float)
        out["original_max_position_embeddings"] = _get(
            scaling, "original_max_position_embeddings", src, int, min_value=1)
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise CheckpointError(f"{src}: rope_scaling needs high_freq_factor > low_freq_factor")
    return theta, out


def _arch(d, src):
    for name in architectures(d, src):
        if name in _ARCHS:
            return _ARCHS[name]
    if not d.get("architectures") and isinstance(d.get("model_type"), str) and \
            d["model_type"] in _MODEL_TYPES:
        return _MODEL_TYPES[d["model_type"]]
    raise CheckpointError(f"{src}: field 'architectures' = {d.get('architectures')!r} names no "
                          f"supported target (supported: {', '.join(_ARCHS)})")


@dataclass(frozen=True)
class TargetConfig:
    """Shape and numerics of a Qwen3 / Llama decoder stack (also the drafter's own layers)."""
    source: str
    arch: str  # "qwen3" (q/k RMSNorm per head) or "llama" (none)
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, {"rope_type": "linear", factor} or llama3 parameters
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    torch_dtype: str | None = None

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def eos_token_ids(self) -> tuple:
        e = self.eos_token_id
        return () if e is None else tuple(e) if isinstance(e, list) else (e,)

    @classmethod
    def from_json(cls, path: str) -> "TargetConfig":
        """path: a model directory or its config.json."""
        src = _config_path(path)
        return cls.from_dict(read_json(src), src)

    @classmethod
    def from_dict(cls, d: dict, src: str = "config.json", arch: str | None = None,
                  drafter: bool = False) -> "TargetConfig":
        arch = arch or _arch(d, src)
        hidden = _get(d, "hidden_size", src, int, min_value=1)
        heads = _get(d, "num_attention_heads", src, int, min_value=1)
        kv_heads = _get(d, "num_key_value_heads", src, int, heads, min_value=1)
        # transformers' Qwen3Config defaults head_dim to 128; Llama derives it
        head_dim = _get(d, "head_dim", src, int, 128 if arch == "qwen3" else hidden // heads,
                        min_value=2)
        if heads % kv_heads:
            raise CheckpointError(f"{src}: num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise CheckpointError(f"{src}: field 'head_dim' must be even for rotary, got {head_dim}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise CheckpointError(f"{src}: field 'attention_bias'/'mlp_bias' = true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{src}: field 'hidden_act' = {d['hidden_act']!r} is not "
                                  "supported (only silu)")
        layers = _get(d, "num_hidden_layers", src, int, min_value=1, max_value=MAX_LAYERS)
        if d.get("use_sliding_window") and d.get("sliding_window") and \
                _get(d, "max_window_layers", src, int, 0) < layers:
            raise CheckpointError(f"{src}: field 'use_sliding_window' = true is not supported")
        kinds = d.get("layer_types") or []
        if not isinstance(kinds, list):
            raise CheckpointError(f"{src}: field 'layer_types' must be a list, got {kinds!r}")
        if "sliding_attention" in kinds:
            raise CheckpointError(f"{src}: field 'layer_types' has sliding_attention layers, "
                                  "which are not supported")
        theta, scaling = _parse_rope(d, src, drafter)
        eps = _get(d, "rms_norm_eps", src, float, 1e-6)
        if not 0 < eps < float("inf"):
            raise CheckpointError(f"{src}: field 'rms_norm_eps' must be a finite number > 0, got {eps!r}")
        vocab = _get(d, "vocab_size", src, int, min_value=1)
        for key in ("bos_token_id", "eos_token_id"):
            ids = _token_ids(d.get(key), src, key)
            bad = [i for i in ([] if ids is None else ids if isinstance(ids, list) else [ids]) if i >= vocab]
            if bad:
                raise CheckpointError(f"{src}: field '{key}' has ids {bad} outside the vocabulary "
                                      f"(vocab_size={vocab})")
        return cls(
            source=src, arch=arch, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            intermediate_size=_get(d, "intermediate_size", src, int, min_value=1),
            vocab_size=_get(d, "vocab_size", src, int, min_value=1),
            rms_norm_eps=eps,
            rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=_get(d, "tie_word_embeddings", src, bool, False),
            max_position_embeddings=_get(d, "max_position_embeddings", src, int, 32768, min_value=1),
            bos_token_id=_token_ids(d.get("bos_token_id"), src, "bos_token_id"),
            eos_token_id=_token_ids(d.get("eos_token_id"), src, "eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"))


def _layer_ids(v, src, key):
    if v is None:
        raise CheckpointError(f"{src}: required field '{key}' is missing")
    if not isinstance(v, list) or not v or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise CheckpointError(f"{src}: field '{key}' must be a non-empty list of ints, got {v!r}")
    return tuple(v)
