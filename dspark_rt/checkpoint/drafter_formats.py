"""The drafter packagings published on model hubs, recognised by the fields they carry (DESIGN §3).

A drafter directory is identified by its fields, never by its `architectures` label alone (hubs
relabel: RadixArk ships DeepSpec tensors as `DSparkDraftModel`, vLLM rewrites labels on load).
`parse(d, src)` turns any supported config.json into one canonical description (`Fields`), in
DeepSpec's conventions: target_layer_ids index target *layers* (-1 = embedding output), the
drafter's own layers are Qwen3 layers, and `layout` names which block slot predicts what.

Packagings (sources; field and tensor names checked against these files):

deepspec     top-level block_size, target_layer_ids, mask_token_id, num_target_layers, markov_rank,
             markov_head_type, enable_confidence_head, confidence_head_with_markov on a copy of
             the *target's* config (deepseek-ai/DeepSpec deepspec/modeling/dspark/qwen3/config.py:
             `draft_config = copy.deepcopy(target_config)`), so target-only fields ride along:
             `partial_rotary_factor` (the stock Qwen3 rotary ignores it: transformers
             models/qwen3/modeling_qwen3.py compute_default_rope_parameters), `use_sliding_window`
             / `sliding_window` (overridden by `layer_types`, which DeepSpec sets to full
             attention), rope scaling (honoured: Qwen3RotaryEmbedding reads it, YaRN included).
             DFlash checkpoints of DeepSpec are the same class with `markov_rank: 0`. Any label
             (Qwen3DSparkModel, a fork's DSparkDraftModel) with these fields is this packaging.
speculators  `speculators_model_type` "dspark" | "dflash" and `transformer_layer_config`
             (vllm-project/speculators src/speculators/models/{dspark,dflash}/config.py). The
             layer config is written by `to_diff_dict`, so fields equal to the transformers class
             default are absent (`_CLASS_DEFAULTS`). `aux_hidden_state_layer_ids` index the
             hidden-state list whose entry 0 is the embedding output: DeepSpec id = aux id - 1
             (vLLM vllm/transformers_utils/configs/speculators/algos.py update_dflash /
             update_dspark). `sample_from_anchor` true = anchor-first (slot k predicts p+k+1),
             false = 1+N; older files omit it and imply it by
             `speculators_config.proposal_methods[0].speculative_tokens` (block_size: anchor-first,
             block_size - 1: 1+N; speculators models/dflash/core.py _build_base_config_kwargs).
             `draft_vocab_size` < vocab_size: tensors `d2t` [V_draft] int64 *offsets* (target id =
             draft id + d2t[draft id]), `t2d` [V] bool, `lm_head.weight` [V_draft, d] and
             `markov_head.markov_w2.weight` [V_draft, r] are draft-vocabulary,
             `markov_head.markov_w1.weight` [V, r] is target-vocabulary (speculators
             src/speculators/model.py DraftVocabMixin, models/dspark/model_definitions.py).
specforge    `dflash_config` holding DSpark fields (markov_rank, markov_head_type,
             enable_confidence_head, confidence_head_with_markov, projector_type "dspark") on
             a Qwen3 config, as `export --to hf` writes it (sgl-project/SpecForge
             specforge/export/to_hf.py: the user's draft config through save_pretrained;
             configs/qwen3-8b-dspark.json). Fields absent take SpecForge's defaults
             (specforge/modeling/draft/dspark.py build_markov_head / _init_draft_head: markov_rank
             0, enable_confidence_head = confidence_head_alpha > 0, confidence_head_with_markov
             false). target_layer_ids index target layers as DeepSpec's do (modeling/draft/
             dflash.py extract_context_feature: hidden_states[id + 1]). The block is
             anchor-first like DeepSpec's, though no field says so: SpecForge's DSpark objective
             labels slot k with anchor + k + 1 (algorithms/common/dflash_family_model.py
             OnlineDSparkModel._build_dspark_labels_and_mask) and SGLang serves it so
             (python/sglang/srt/speculative/dspark_components/dspark_config.py: gamma =
             block_size); only its DFlash objective (projector "dflash") is 1+N. SpecForge's
             SGLang normaliser (scripts/gates/normalize_dflash_export.py) copies the head fields
             to the top level and relabels Qwen3DSparkModel, keeping dflash_config: the same
             packaging. `sample_from_anchor` still wins where a file carries it. Rope scaling
             honoured (YaRN); `draft_vocab_size` with the same d2t / t2d buffers as speculators
             (specforge/modeling/draft/vocab_mixin.py: t2d bool, i + d2t[i] the target id).
zlab         `dflash_config` {mask_token_id, target_layer_ids, block_size?} (z-lab/dflash
             dflash/model.py): 1+N block; `layer_types` "sliding_attention" layers attend within
             `sliding_window` and, unless `is_causal` says otherwise, causally inside the block;
             `input_embedding_scale`, `output_multiplier`, `final_logit_softcapping` in
             dflash_config scale the noise embedding and the draft logits.

Also read wherever they appear: `sts_temperatures` (per-position STS temperatures shipped in the
config; TensorRT-LLM / ATOM spell the calibration key so), `rope_interleave` (q/k rotated in
consecutive pairs; the loader permutes q/k rows to the half-split layout, which is exact),
SGLang's nested `dspark_config` (python/sglang/srt/speculative/dspark_components/
dspark_config.py). `DFlash2DraftModel` (candidate selector, dynamic convolution) parses in
z-lab's packaging when the caller allows it (models/load.py; models/dflash2.py serves it).
Anything that cannot be served exactly is a CheckpointError naming the field.
"""
import sys
from dataclasses import dataclass

from .config import (HEAD_TYPES, MAX_LAYERS, CheckpointError, TargetConfig, _get, _layer_ids,
                     architectures)

__all__ = ["Fields", "parse", "PACKAGINGS"]

PACKAGINGS = ("deepspec", "speculators", "specforge", "zlab")
_DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov")
_DFLASH2_KEYS = ("selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size")
_FOREIGN = ("Eagle", "Medusa", "MTP", "Hydra", "Peagle", "PEagle")  # other drafter families
# transformers 4.x class defaults that to_diff_dict leaves out (Qwen3Config, LlamaConfig)
_CLASS_DEFAULTS = {
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  head_dim=128, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                  attention_bias=False),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_theta=10000.0, attention_bias=False, mlp_bias=False),
}


@dataclass(frozen=True)
class Fields:
    packaging: str
    model: TargetConfig  # the drafter's own Qwen3 layers
    block_size: int
    layout: str  # "anchor_first" | "one_plus_n"
    target_layer_ids: tuple  # DeepSpec indexing
    mask_token_id: int
    num_target_layers: int | None
    markov_rank: int = 0
    head: str = "none"
    confidence: bool = False
    confidence_markov: bool = False
    draft_vocab_size: int | None = None  # None: the target's vocabulary
    sts_temperatures: tuple | None = None
    causal_layers: tuple = ()  # per drafter layer: causal inside the block
    sliding_window: int | None = None  # window of the sliding layers (None: no sliding layer)
    window_layers: tuple = ()  # per drafter layer: a sliding layer (attends within the window)
    rope_interleave: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    dflash2: dict | None = None  # DFlash2 convolution / selector fields (models/dflash2.py)


def _is_dflash2(d, archs, nested):
    return "DFlash2DraftModel" in archs or d.get("speculators_model_type") == "dflash2" or \
        any(k in n for n in nested.values() for k in _DFLASH2_KEYS)


def parse(d: dict, src: str, allow_dflash2: bool = False) -> Fields:
    archs = architectures(d, src)
    nested = {k: d[k] for k in ("dflash_config", "dspark_config") if isinstance(d.get(k), dict)}
    if _is_dflash2(d, archs, nested):
        what = (f"{src}: field 'architectures' = {archs!r} / dflash_config "
                f"{sorted(k for n in nested.values() for k in n if k in _DFLASH2_KEYS)}: a "
                "DFlash2DraftModel drafter (candidate selector, dynamic convolution)")
        if "dflash_config" not in nested:
            raise CheckpointError(f"{what} is served in z-lab's packaging (fields nested in "
                                  "dflash_config) only")
        if not allow_dflash2:
            raise CheckpointError(f"{what} loads through models.load.load_drafter (as "
                                  "Decoder.from_pretrained does)")
    foreign = [a for a in archs if any(f in a for f in _FOREIGN)]
    if foreign:
        raise CheckpointError(f"{src}: field 'architectures' = {archs!r} names a drafter family "
                              "that is not DSpark / DFlash")
    if "speculators_model_type" in d or "transformer_layer_config" in d:
        return _speculators(d, src)
    if nested:
        return _nested(d, nested, src)
    if "target_layer_ids" in d and ("markov_rank" in d or "num_target_layers" in d):
        return _deepspec(d, src)
    raise CheckpointError(f"{src}: field 'architectures' = {archs!r} names no supported drafter "
                          "and the config carries no DSpark / DFlash fields (Qwen3DSparkModel, "
                          "DFlashDraftModel, speculators DSparkDraftModel / DSparkSpeculator, "
                          "SpecForge DSparkDraftModel)")


# -- the drafter's own layers ------------------------------------------------------------------

def _layer_config(d: dict, src: str, *, trust_layer_types: bool) -> tuple:
    """TargetConfig of the drafter's Qwen3 layers plus (layer kinds, window). Target-only fields a
    copied config carries are dropped where the reference model ignores them."""
    d = dict(d)
    d.pop("partial_rotary_factor", None)  # the stock Qwen3 rotary covers the whole head
    for key in ("rope_parameters", "rope_scaling"):
        rp = d.get(key)
        if isinstance(rp, dict) and rp.get("rope_type", rp.get("type", "default")) == "default":
            d[key] = {k: v for k, v in rp.items() if k != "partial_rotary_factor"}
    n = _get(d, "num_hidden_layers", src, int, min_value=1, max_value=MAX_LAYERS)
    kinds = d.get("layer_types")
    if not kinds:  # transformers' Qwen3Config derives them: sliding from max_window_layers on
        sliding = d.get("sliding_window") if d.get("use_sliding_window") else None
        first = _get(d, "max_window_layers", src, int, 0)
        kinds = ["sliding_attention" if sliding is not None and i >= first else "full_attention"
                 for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or \
            any(k not in ("full_attention", "sliding_attention") for k in kinds):
        raise CheckpointError(f"{src}: field 'layer_types' = {kinds!r} must list full_attention / "
                              f"sliding_attention for each of the {n} drafter layers")
    window = None
    if "sliding_attention" in kinds:
        if not trust_layer_types:
            raise CheckpointError(f"{src}: field 'layer_types' has sliding_attention layers, "
                                  "which this packaging does not define")
        window = _get(d, "sliding_window", src, int, min_value=1)
    # sliding is decided by layer_types alone (as in the reference models), not use_sliding_window
    for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
        d.pop(key, None)
    return TargetConfig.from_dict(d, src, arch="qwen3", drafter=True), tuple(kinds), window


def _with_class_defaults(tl: dict, src: str) -> dict:
    kind = tl.get("model_type", "qwen3")
    if not isinstance(kind, str) or kind not in _CLASS_DEFAULTS:
        raise CheckpointError(f"{src}: field 'transformer_layer_config.model_type' = {kind!r} is "
                              f"not supported ({', '.join(_CLASS_DEFAULTS)})")
    out = {**_CLASS_DEFAULTS[kind], **{k: v for k, v in tl.items() if v is not None}}
    out.setdefault("num_key_value_heads", out["num_attention_heads"])
    if kind == "llama" and "head_dim" not in out:  # derived as LlamaConfig does, from checked ints
        out["head_dim"] = _get(out, "hidden_size", src, int, min_value=1) // \
            _get(out, "num_attention_heads", src, int, min_value=1)
    return out


# -- heads -------------------------------------------------------------------------------------

def _heads(get, src, *, defaults=None):
    """(markov_rank, head, confidence, confidence_markov) from a field getter."""
    defaults = defaults or {}
    rank = get("markov_rank", int, defaults.get("markov_rank"), 0)
    head = "none"
    if rank > 0:
        head = get("markov_head_type", str, defaults.get("markov_head_type"))
        if head not in HEAD_TYPES:
            raise CheckpointError(f"{src}: field 'markov_head_type' = {head!r} is not a known "
                                  f"head type ({', '.join(HEAD_TYPES)})")
    conf = get("enable_confidence_head", bool, defaults.get("enable_confidence_head"))
    conf_markov = get("confidence_head_with_markov", bool,
                      defaults.get("confidence_head_with_markov")) if conf else False
    if conf_markov and rank == 0:
        raise CheckpointError(f"{src}: field 'confidence_head_with_markov' is true but "
                              "markov_rank is 0")
    return rank, head, conf, conf_markov


def _getter(sources, src):
    """get(key, kind, default=REQUIRED, min_value=None): the first source holding key wins."""
    def get(key, kind, default=None, min_value=None, *, required=True):
        for s in sources:
            if s.get(key) is not None:
                if kind in (str, list):
                    if not isinstance(s[key], kind):
                        raise CheckpointError(f"{src}: field '{key}' must be {kind.__name__}, "
                                              f"got {s[key]!r}")
                    return s[key]
                return _get(s, key, src, kind, min_value=min_value)
        if default is not None:
            return default
        if not required:
            return None
        raise CheckpointError(f"{src}: required field '{key}' is missing")
    return get


def _sts(get, src, gamma):
    temps = get("sts_temperatures", list, required=False)
    if temps is None:
        return None
    if len(temps) != gamma or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                      and 0 < t <= sys.float_info.max for t in temps):
        raise CheckpointError(f"{src}: field 'sts_temperatures' must hold {gamma} finite positive "
                              f"numbers (one per draft position), got {temps!r}")
    return tuple(float(t) for t in temps)


def _layout(get, src, default):
    """anchor_first | one_plus_n from sample_from_anchor (speculators, SGLang) or vLLM's
    dspark_bonus_anchor, else the packaging's default."""
    sfa = get("sample_from_anchor", bool, required=False)
    bonus = get("dspark_bonus_anchor", bool, required=False)
    if sfa is not None and bonus is not None and sfa == bonus:
        raise CheckpointError(f"{src}: fields 'sample_from_anchor' = {sfa} and "
                              f"'dspark_bonus_anchor' = {bonus} contradict each other")
    if sfa is not None:
        return "anchor_first" if sfa else "one_plus_n"
    if bonus is not None:
        return "one_plus_n" if bonus else "anchor_first"
    return default


def _finish(packaging, d, src, get, model, window, *, kinds, block, layout, ids, mask, n_target,
            heads, causal, draft_vocab=None, dflash2=None):
    rank, head, conf, conf_markov = heads
    if layout == "one_plus_n" and block < 2:
        raise CheckpointError(f"{src}: field 'block_size' = {block}: a 1+N block needs >= 2 slots")
    gamma = block if layout == "anchor_first" else block - 1
    softcap = get("final_logit_softcapping", float, required=False)
    if softcap and dflash2 is None:
        raise CheckpointError(f"{src}: field 'final_logit_softcapping' = {softcap}: capped draft "
                              "logits are not served (the runner adds the head to raw logits)")
    if draft_vocab is not None and draft_vocab > model.vocab_size:
        raise CheckpointError(f"{src}: field 'draft_vocab_size' = {draft_vocab} exceeds "
                              f"vocab_size = {model.vocab_size}")
    return Fields(
        packaging=packaging, model=model, block_size=block, layout=layout,
        target_layer_ids=ids, mask_token_id=mask, num_target_layers=n_target,
        markov_rank=rank, head=head, confidence=conf, confidence_markov=conf_markov,
        draft_vocab_size=None if draft_vocab in (None, model.vocab_size) else draft_vocab,
        sts_temperatures=_sts(get, src, gamma), causal_layers=tuple(causal), sliding_window=window,
        window_layers=tuple(k == "sliding_attention" for k in kinds),
        rope_interleave=bool(get("rope_interleave", bool, required=False)),
        input_embedding_scale=get("input_embedding_scale", float, 1.0),
        output_multiplier=get("output_multiplier", float, 1.0), dflash2=dflash2)


# -- packagings --------------------------------------------------------------------------------

def _deepspec(d, src):
    get = _getter([d], src)
    model, kinds, window = _layer_config(d, src, trust_layer_types=False)
    n_target = get("num_target_layers", int, min_value=1)
    # DeepSpec's attention is bidirectional inside the block whatever the copied config says
    return _finish("deepspec", d, src, get, model, window, kinds=kinds,
                   block=get("block_size", int, min_value=1), layout=_layout(get, src, "anchor_first"),
                   ids=_layer_ids(d.get("target_layer_ids"), src, "target_layer_ids"),
                   mask=get("mask_token_id", int, min_value=0), n_target=n_target,
                   heads=_heads(get, src), causal=[False] * len(kinds))


def _nested(d, nested, src):
    dc = {**nested.get("dspark_config", {}), **nested.get("dflash_config", {})}
    get = _getter([dc, d], src)
    # the projector names the model where present (SpecForge: DSparkDraftModel requires "dspark")
    projector = dc.get("projector_type")
    is_dspark = projector == "dspark" or \
        (projector is None and any(k in dc or k in d for k in _DSPARK_KEYS))
    if projector not in (None, "dflash", "dspark"):
        raise CheckpointError(f"{src}: field 'dflash_config.projector_type' = {projector!r} is "
                              "not served (dflash, dspark)")
    if dc.get("attention_mode", "gqa") != "gqa" or "attention_modes" in dc:
        raise CheckpointError(f"{src}: field 'dflash_config.attention_mode' = "
                              f"{dc.get('attention_mode', dc.get('attention_modes'))!r} is not "
                              "served (gqa)")
    model, kinds, window = _layer_config(d, src, trust_layer_types=True)
    ids = _layer_ids(dc.get("target_layer_ids", d.get("target_layer_ids")), src,
                     "dflash_config.target_layer_ids")
    n_target = get("num_target_layers", int, required=False)
    # SpecForge's defaults for the head fields a draft config leaves out (modeling/draft/dspark.py
    # build_markov_head, DSparkDraftModel._init_draft_head)
    alpha = get("confidence_head_alpha", float, required=False) or 0.0
    defaults = dict(markov_rank=0, markov_head_type="vanilla", enable_confidence_head=alpha > 0,
                    confidence_head_with_markov=False)
    dflash2 = None
    if _is_dflash2(d, architectures(d, src), nested):
        dflash2 = {k: get(k, int, min_value=1) for k in _DFLASH2_KEYS}
        dflash2.update(output_multiplier=get("output_multiplier", float, 1.0),
                       final_logit_softcapping=get("final_logit_softcapping", float, 0.0))
        if model.hidden_size % dflash2["conv_group_size"]:
            raise CheckpointError(f"{src}: field 'conv_group_size' = "
                                  f"{dflash2['conv_group_size']} does not divide hidden_size")
        if dflash2["selector_top_k"] > model.vocab_size:
            raise CheckpointError(f"{src}: field 'selector_top_k' = {dflash2['selector_top_k']} "
                                  f"exceeds vocab_size = {model.vocab_size}")
    # z-lab: a sliding layer is causal inside the block unless is_causal says otherwise
    is_causal = get("is_causal", bool, required=False)
    causal = [k == "sliding_attention" if is_causal is None else is_causal for k in kinds]
    # DSpark (SpecForge, SGLang) is trained anchor-first, z-lab's DFlash 1+N
    layout = _layout(get, src, "anchor_first" if is_dspark else "one_plus_n")
    heads = _heads(get, src, defaults=defaults)
    if not is_dspark and (heads[0] or heads[2]):
        raise CheckpointError(f"{src}: field 'dflash_config.projector_type' = {projector!r} names "
                              "a DFlash drafter, but markov_rank / enable_confidence_head give it "
                              "DSpark heads")
    return _finish("specforge" if is_dspark else "zlab", d, src, get, model, window, kinds=kinds,
                   block=get("block_size", int, min_value=1), layout=layout,
                   ids=ids, mask=get("mask_token_id", int, min_value=0), n_target=n_target,
                   heads=heads, causal=causal,
                   draft_vocab=get("draft_vocab_size", int, required=False, min_value=1),
                   dflash2=dflash2)


def _speculators(d, src):
    kind = d.get("speculators_model_type")
    if kind not in ("dspark", "dflash"):
        raise CheckpointError(f"{src}: field 'speculators_model_type' = {kind!r} is not served "
                              "(dspark, dflash)")
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise CheckpointError(f"{src}: required field 'transformer_layer_config' is missing")
    tl = _with_class_defaults(tl, src)
    get = _getter([d], src)
    for key, bad in (("projector_type", lambda v: v not in (None, "dflash")),
                     ("shift_label", bool)):
        if bad(d.get(key)):
            raise CheckpointError(f"{src}: field '{key}' = {d[key]!r} is not served")
    model, kinds, window = _layer_config(tl, src + " transformer_layer_config",
                                         trust_layer_types=True)
    th = d.get("target_hidden_size")
    if th is not None and th != model.hidden_size:
        raise CheckpointError(f"{src}: field 'target_hidden_size' = {th} differs from the "
                              f"drafter's hidden_size = {model.hidden_size}: not served")
    aux = _layer_ids(d.get("aux_hidden_state_layer_ids"), src, "aux_hidden_state_layer_ids")
    if min(aux) < 0:
        raise CheckpointError(f"{src}: field 'aux_hidden_state_layer_ids' = {list(aux)} indexes "
                              "hidden states from 0 (the embedding output); negative ids are invalid")
    block = get("block_size", int, 8, min_value=1)
    layout = _layout(get, src, None)
    spec = _speculative_tokens(d, src)
    if spec is not None and spec not in (block, block - 1):
        raise CheckpointError(f"{src}: field 'speculators_config.proposal_methods[0]."
                              f"speculative_tokens' = {spec} fits neither layout of "
                              f"block_size = {block}")
    implied = None if spec is None else "anchor_first" if spec == block else "one_plus_n"
    if layout is None:
        if implied is None:
            raise CheckpointError(f"{src}: neither field 'sample_from_anchor' nor "
                                  "'speculators_config.proposal_methods[0].speculative_tokens' "
                                  "says which block slot is the anchor")
        layout = implied
    elif implied is not None and implied != layout:
        raise CheckpointError(f"{src}: field 'sample_from_anchor' contradicts "
                              f"'speculative_tokens' = {spec} (block_size = {block})")
    if "sliding_attention" in kinds and d.get("sliding_window_non_causal") is None:
        raise CheckpointError(f"{src}: field 'sliding_window_non_causal' is missing but the "
                              "drafter has sliding_attention layers (its default differs between "
                              "speculators and vLLM)")
    causal = [k == "sliding_attention" and not d["sliding_window_non_causal"] for k in kinds]
    heads = _heads(get, src, defaults=dict(markov_rank=0, markov_head_type="vanilla",
                                           enable_confidence_head=False,
                                           confidence_head_with_markov=False)) \
        if kind == "dspark" else (0, "none", False, False)
    return _finish("speculators", d, src, get, model, window, kinds=kinds, block=block, layout=layout,
                   ids=tuple(i - 1 for i in aux), mask=get("mask_token_id", int, min_value=0),
                   n_target=None, heads=heads, causal=causal,
                   draft_vocab=get("draft_vocab_size", int, required=False, min_value=1))


def _speculative_tokens(d, src):
    sc = d.get("speculators_config")
    if not isinstance(sc, dict):
        return None
    methods = sc.get("proposal_methods") or []
    if not isinstance(methods, list):
        raise CheckpointError(f"{src}: field 'speculators_config.proposal_methods' must be a list, "
                              f"got {methods!r}")
    if not methods or not isinstance(methods[0], dict) or methods[0].get("speculative_tokens") is None:
        return None
    return _get(methods[0], "speculative_tokens", src, int, min_value=1)
