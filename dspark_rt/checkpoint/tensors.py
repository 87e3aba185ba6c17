"""Safetensors checkpoints: find the tensors, check them against the config, load them (DESIGN §3).

Checking reads only the safetensors headers, so a bad directory fails in milliseconds and before
any model is built. Extra tensors are ignored (rotary inv_freq, optimizer leftovers), except ones
that look like weights of a decoder layer the config does not have.
"""
import glob
import os
import re

import torch
from safetensors import safe_open

from .config import CheckpointError, TargetConfig, read_json
from .drafter_config import DrafterConfig

__all__ = ["Checkpoint", "resolve_dtype", "layer_specs", "target_specs", "drafter_specs", "dflash2_specs",
           "drafter_aliases"]

INDEX_FILE = "model.safetensors.index.json"
# The runtime's one table of float dtypes: by name (users, CLI) and by safetensors code (files).
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16}
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")

Spec = dict  # tensor name -> expected shape tuple


def resolve_dtype(dtype) -> torch.dtype:
    """torch.dtype or a name ("bfloat16", "bf16", "float32", ...) -> a floating torch.dtype."""
    if isinstance(dtype, torch.dtype) and dtype in set(DTYPE_NAMES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype must be one of float32, float16, bfloat16, float64, got {dtype!r}")


class Checkpoint:
    """The tensors of a model directory, from the safetensors headers: name -> file, shape, dtype."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: field 'weight_map' is missing or empty")
            files = sorted(set(weight_map.values()))
            self.index_file = index
        else:
            files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
            weight_map = None
            self.index_file = os.path.join(path, "model.safetensors")
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files (and no {INDEX_FILE})")
        self.entries = {}  # name -> (file, shape, safetensors dtype string)
        for fname in files:
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                raise CheckpointError(f"{index}: shard '{fname}' listed in weight_map does not exist")
            try:
                with safe_open(fpath, framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        if name in self.entries:
                            raise CheckpointError(f"{fpath}: tensor '{name}' is also in "
                                                  f"{self.entries[name][0]}")
                        self.entries[name] = (fpath, tuple(sl.get_shape()), sl.get_dtype())
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{fpath}: cannot read safetensors header ({e})") from None
        if weight_map is not None:
            for name, fname in weight_map.items():
                got = self.entries.get(name)
                if got is not None and os.path.basename(got[0]) != fname:
                    raise CheckpointError(f"{index}: tensor '{name}' is mapped to {fname} but "
                                          f"stored in {got[0]}")

    def file_of(self, name: str) -> str:
        return self.entries[name][0] if name in self.entries else self.index_file

    def check(self, required: Spec, optional: Spec = None, *, num_layers: int):
        """Required tensors must exist; required and present optional ones need the expected
        shape and a float dtype; a tensor of a decoder layer >= num_layers is an error."""
        optional = optional or {}
        for name, shape in required.items():
            if name not in self.entries:
                raise CheckpointError(f"{self.index_file}: tensor '{name}' is missing "
                                      f"(expected shape {tuple(shape)})")
        for name, shape in {**optional, **required}.items():
            if name not in self.entries:
                continue
            fpath, got, dt = self.entries[name][:3]
            if got != tuple(shape):
                raise CheckpointError(f"{fpath}: tensor '{name}' has shape {got}, expected "
                                      f"{tuple(shape)}")
            if dt not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{fpath}: tensor '{name}' has dtype {dt}, expected a float "
                                      f"dtype ({', '.join(SAFETENSORS_DTYPES)})")
        for name, (fpath, *_) in self.entries.items():
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= num_layers:
                raise CheckpointError(f"{fpath}: tensor '{name}' belongs to layer {m.group(1)} but "
                                      f"the config has num_hidden_layers={num_layers}")

    def rename(self, aliases: dict):
        """aliases: canonical name -> stored name; the entry is then found under its canonical
        name (same weights under another name in some packagings)."""
        for canonical, stored in aliases.items():
            if canonical not in self.entries and stored in self.entries:
                self.entries[canonical] = self.entries.pop(stored) + (stored,)

    def load_index_tensor(self, name: str, shape: tuple, device) -> torch.Tensor:
        """An integer tensor (a vocabulary map), checked for shape and an integer dtype."""
        if name not in self.entries:
            raise CheckpointError(f"{self.index_file}: tensor '{name}' is missing "
                                  f"(expected shape {tuple(shape)}, integers)")
        fpath, got, dt = self.entries[name][:3]
        if got != tuple(shape) or dt not in ("I64", "I32", "I16", "U8", "I8", "BOOL"):
            raise CheckpointError(f"{fpath}: tensor '{name}' has shape {got} and dtype {dt}, "
                                  f"expected shape {tuple(shape)} and an integer (or bool) dtype")
        with safe_open(fpath, framework="pt", device=str(device)) as f:
            return f.get_tensor(self.stored_name(name)).long()

    def stored_name(self, name: str) -> str:
        e = self.entries[name]
        return e[3] if len(e) > 3 else name

    def load(self, names, dtype, device, slices=None) -> dict:
        """Reads the named tensors, cast to dtype, on device. slices: name -> (dim, lo, hi) to
        read only rows (dim 0) or columns (dim 1) lo .. hi-1 of a tensor (tensor parallelism);
        names without one are read whole."""
        dtype, device = resolve_dtype(dtype), torch.device(device)
        slices = slices or {}
        by_file = {}
        for name in names:
            by_file.setdefault(self.file_of(name), []).append(name)
        out = {}
        for fpath, group in by_file.items():
            with safe_open(fpath, framework="pt", device=str(device)) as f:
                for name in group:
                    if slices.get(name) is None:
                        t = f.get_tensor(self.stored_name(name))
                    else:
                        dim, lo, hi = slices[name]
                        part = f.get_slice(self.stored_name(name))
                        t = part[lo:hi] if dim == 0 else part[:, lo:hi]
                    out[name] = t.to(dtype)
        return out


def layer_specs(prefix: str, cfg: TargetConfig) -> Spec:
    """Tensor shapes of one Qwen3 / Llama decoder layer named `{prefix}self_attn.q_proj.weight`..."""
    d, hq, hkv, hd, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.head_dim, cfg.intermediate_size)
    s = {f"{prefix}self_attn.q_proj.weight": (hq * hd, d),
         f"{prefix}self_attn.k_proj.weight": (hkv * hd, d),
         f"{prefix}self_attn.v_proj.weight": (hkv * hd, d),
         f"{prefix}self_attn.o_proj.weight": (d, hq * hd),
         f"{prefix}mlp.gate_proj.weight": (inter, d),
         f"{prefix}mlp.up_proj.weight": (inter, d),
         f"{prefix}mlp.down_proj.weight": (d, inter),
         f"{prefix}input_layernorm.weight": (d,),
         f"{prefix}post_attention_layernorm.weight": (d,)}
    if cfg.qk_norm:
        s[f"{prefix}self_attn.q_norm.weight"] = (hd,)
        s[f"{prefix}self_attn.k_norm.weight"] = (hd,)
    return s


def target_specs(cfg: TargetConfig) -> tuple:
    """(required, optional) tensor shapes of a transformers Qwen3 / Llama checkpoint."""
    V, d = cfg.vocab_size, cfg.hidden_size
    req = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_hidden_layers):
        req.update(layer_specs(f"model.layers.{i}.", cfg))
    opt = {}
    # tied checkpoints usually omit lm_head.weight; when present it must still have the right shape
    (opt if cfg.tie_word_embeddings else req)["lm_head.weight"] = (V, d)
    return req, opt


def drafter_specs(dcfg: DrafterConfig) -> tuple:
    """(required, optional) tensor shapes of a drafter checkpoint in canonical (DeepSpec) names.
    With a reduced draft vocabulary (speculators draft_vocab_size) markov_w2 and lm_head have
    V_draft rows and markov_w1 keeps the target's V (speculators models/dspark/model_definitions.py);
    the d2t / t2d index tensors are read apart (Checkpoint.load_index_tensor)."""
    cfg = dcfg.model
    V, d, r, m = cfg.vocab_size, cfg.hidden_size, dcfg.markov_rank, len(dcfg.target_layer_ids)
    Vd = dcfg.draft_vocab_size or V
    req = {"norm.weight": (d,), "fc.weight": (d, m * d), "hidden_norm.weight": (d,)}
    for i in range(cfg.num_hidden_layers):
        req.update(layer_specs(f"layers.{i}.", cfg))
    if dcfg.head != "none":
        req["markov_head.markov_w1.weight"] = (V, r)
        req["markov_head.markov_w2.weight"] = (Vd, r)
    if dcfg.head == "gated":
        req["markov_head.gate_proj.weight"] = (r, d + r)
        req["markov_head.gate_proj.bias"] = (r,)
    if dcfg.head == "rnn":
        req["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
        req["markov_head.joint_proj.bias"] = (3 * r,)
    opt = {}
    if dcfg.confidence:
        req["confidence_head.proj.weight"] = (1, d + r if dcfg.confidence_markov else d)
        opt["confidence_head.proj.bias"] = (1,)  # SGLang's DSparkConfidenceHead may omit it
    # DeepSpec files carry copies of the target's embedding and LM head; speculators files carry
    # the draft-vocabulary LM head. The runtime uses the target's own (drafter_tensors.adapt
    # checks the copies equal it)
    opt.update({"embed_tokens.weight": (V, d), "lm_head.weight": (Vd, d)})
    return req, opt


def drafter_aliases(names) -> dict:
    """canonical name -> the name other packagings store it under: a `model.` prefix (SGLang
    strips it when loading, python/sglang/srt/models/dspark.py), and `confidence_head.{weight,
    bias}` without the `.proj` module (the trainer exports in vime, speculators forks)."""
    out = {}
    for n in names:
        out[n] = "model." + n
        if n.endswith("_codebook.weight"):  # DFlash2 stores its codebooks without .weight
            out[n] = n.removesuffix(".weight")
        if n.startswith("confidence_head.proj."):
            out[n] = "confidence_head." + n.removeprefix("confidence_head.proj.")
    return out


def dflash2_specs(dcfg) -> dict:
    """Shapes of the DFlash2 tensors beyond a DFlash drafter's (z-lab/dflash
    tests/fixtures/dflash2-safetensors-header.json); the codebooks may be stored without
    `.weight` (DFlash2DraftModel.from_pretrained key_mapping)."""
    f, d, V = dcfg.dflash2, dcfg.hidden_size, dcfg.vocab_size
    k, groups, r = f["conv_kernel_size"], d // f["conv_group_size"], f["selector_rank"]
    s = {"candidate_selector.hidden_projection.weight": (r, d),
         "candidate_selector.predecessor_codebook.weight": (V, r),
         "candidate_selector.successor_codebook.weight": (V, r)}
    for i in range(dcfg.num_hidden_layers):
        for c in ("attention_conv", "mlp_conv"):
            s[f"layers.{i}.{c}.base_kernel"] = (2, k, d)
            s[f"layers.{i}.{c}.kernel_projection.weight"] = (2 * k * groups, d)
    return s
