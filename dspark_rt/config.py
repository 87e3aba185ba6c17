"""Model configurations parsed from Hugging Face / DeepSpec / z-lab `config.json` files (DESIGN §3).

Every problem is a CheckpointError whose message names the file and the field, raised before any
weight is read.
"""
import json
import os
from dataclasses import dataclass

__all__ = ["CheckpointError", "TargetConfig", "DrafterConfig", "read_json"]

HEAD_TYPES = ("vanilla", "gated", "rnn")  # markov_head_type values; "none" means markov_rank 0
ROPE_TYPES = ("default", "linear", "llama3")
_ARCHS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}
_REQUIRED = object()


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file and field/tensor."""


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return out


def _config_path(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def _get(d, key, src, kind, default=_REQUIRED, *, min_value=None):
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
    if min_value is not None and v < min_value:
        raise CheckpointError(f"{src}: field '{key}' must be >= {min_value}, got {v!r}")
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
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
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
    for name in d.get("architectures") or []:
        if name in _ARCHS:
            return _ARCHS[name]
    if not d.get("architectures") and d.get("model_type") in _MODEL_TYPES:
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
        layers = _get(d, "num_hidden_layers", src, int, min_value=1)
        if d.get("use_sliding_window") and d.get("sliding_window") and \
                int(d.get("max_window_layers", 0)) < layers:
            raise CheckpointError(f"{src}: field 'use_sliding_window' = true is not supported")
        if "sliding_attention" in (d.get("layer_types") or []):
            raise CheckpointError(f"{src}: field 'layer_types' has sliding_attention layers, "
                                  "which are not supported")
        theta, scaling = _parse_rope(d, src, drafter)
        return cls(
            source=src, arch=arch, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            intermediate_size=_get(d, "intermediate_size", src, int, min_value=1),
            vocab_size=_get(d, "vocab_size", src, int, min_value=1),
            rms_norm_eps=_get(d, "rms_norm_eps", src, float, 1e-6),
            rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=_get(d, "tie_word_embeddings", src, bool, False),
            max_position_embeddings=_get(d, "max_position_embeddings", src, int, 32768, min_value=1),
            bos_token_id=_token_ids(d.get("bos_token_id"), src, "bos_token_id"),
            eos_token_id=_token_ids(d.get("eos_token_id"), src, "eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"))


@dataclass(frozen=True)
class DrafterConfig:
    """A DSpark / DFlash drafter in any supported packaging (dspark_rt/drafter_formats.py), in
    DeepSpec's conventions. `format` names the packaging: "deepspec", "speculators",
    "specforge" or "zlab"."""
    source: str
    format: str
    model: TargetConfig  # the drafter's own decoder layers (Qwen3 layers, q/k norms)
    block_size: int
    target_layer_ids: tuple
    mask_token_id: int
    num_target_layers: int | None  # z-lab / speculators configs do not carry it
    markov_rank: int = 0
    head: str = "none"  # "none" | "vanilla" | "gated" | "rnn"
    confidence: bool = False
    confidence_markov: bool = False
    block_layout: str = "anchor_first"  # or "one_plus_n": slot j >= 1 predicts position p + j
    draft_vocab_size: int | None = None  # reduced draft vocabulary (d2t offsets), else None
    sts_temperatures: tuple | None = None  # STS temperatures shipped in the config
    causal_layers: tuple = ()  # per drafter layer: causal inside the block (z-lab sliding layers)
    sliding_window: int | None = None
    rope_interleave: bool = False  # q/k rows rotate in consecutive pairs (permuted at load)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    dflash2: dict | None = None  # DFlash2DraftModel fields (parsed only when asked for)

    @property
    def layout(self) -> str:
        return self.block_layout

    @property
    def gamma(self) -> int:
        """Drafts per round: anchor-first blocks predict from every slot, 1+N blocks skip slot 0."""
        return self.block_size if self.layout == "anchor_first" else self.block_size - 1

    # the drafter's own layer shapes, read through (for sizing its KV cache)
    hidden_size = property(lambda self: self.model.hidden_size)
    vocab_size = property(lambda self: self.model.vocab_size)
    num_hidden_layers = property(lambda self: self.model.num_hidden_layers)
    num_attention_heads = property(lambda self: self.model.num_attention_heads)
    num_key_value_heads = property(lambda self: self.model.num_key_value_heads)
    head_dim = property(lambda self: self.model.head_dim)

    @classmethod
    def from_json(cls, path: str, allow_dflash2: bool = False) -> "DrafterConfig":
        src = _config_path(path)
        return cls.from_dict(read_json(src), src, allow_dflash2)

    @classmethod
    def from_dict(cls, d: dict, src: str = "config.json",
                  allow_dflash2: bool = False) -> "DrafterConfig":
        from .drafter_formats import parse
        f = parse(d, src, allow_dflash2)
        out = cls(source=src, format=f.packaging, model=f.model, block_size=f.block_size,
                  target_layer_ids=f.target_layer_ids, mask_token_id=f.mask_token_id,
                  num_target_layers=f.num_target_layers, markov_rank=f.markov_rank, head=f.head,
                  confidence=f.confidence, confidence_markov=f.confidence_markov,
                  block_layout=f.layout, draft_vocab_size=f.draft_vocab_size,
                  sts_temperatures=f.sts_temperatures, causal_layers=f.causal_layers,
                  sliding_window=f.sliding_window, rope_interleave=f.rope_interleave,
                  input_embedding_scale=f.input_embedding_scale,
                  output_multiplier=f.output_multiplier, dflash2=f.dflash2)
        out._check_ranges(out.num_target_layers)
        return out

    def _check_ranges(self, n_target: int | None):
        for lid in self.target_layer_ids if n_target is not None else ():
            if not -1 <= lid < n_target - 1:
                raise CheckpointError(
                    f"{self.source}: field 'target_layer_ids' has layer id {lid} out of range: "
                    f"ids must satisfy -1 <= id < {n_target - 1} (num_target_layers={n_target}; "
                    "-1 is the embedding output, the final layer is not allowed)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"{self.source}: field 'mask_token_id' = {self.mask_token_id} "
                                  f"is outside the vocabulary (vocab_size={self.vocab_size})")

    def check_target(self, target: TargetConfig):
        """Cross-checks against the target the drafter will run with."""
        for key in ("vocab_size", "hidden_size"):
            mine, theirs = getattr(self.model, key), getattr(target, key)
            if mine != theirs:
                raise CheckpointError(f"{self.source}: field '{key}' = {mine} does not match the "
                                      f"target's {key} = {theirs} ({target.source})")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            raise CheckpointError(
                f"{self.source}: field 'num_target_layers' = {self.num_target_layers} does not match "
                f"the target's num_hidden_layers = {target.num_hidden_layers} ({target.source})")
        self._check_ranges(target.num_hidden_layers)
        if self.sliding_window is not None and self.sliding_window < target.max_position_embeddings:
            raise CheckpointError(
                f"{self.source}: field 'sliding_window' = {self.sliding_window} is below the "
                f"target's max_position_embeddings = {target.max_position_embeddings}: the "
                "window would bind, and windowed drafter attention is not served")


def _layer_ids(v, src, key):
    if v is None:
        raise CheckpointError(f"{src}: required field '{key}' is missing")
    if not isinstance(v, list) or not v or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise CheckpointError(f"{src}: field '{key}' must be a non-empty list of ints, got {v!r}")
    return tuple(v)
