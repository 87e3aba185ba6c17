"""Every published drafter packaging loads to the same drafter as its canonical layout.

A mis-parsed drafter keeps the output exact (rejection sampling guarantees it) and only loses
acceptance, so equal tokens prove nothing. Each case writes the *same trained weights* (the
shipped pair in dspark_rt/pretrained) in a packaging's layout (tests/support/packagings.py) and in the
canonical DeepSpec layout, decodes both greedily in float64, and asserts identical tokens, equal
to plain decoding, and identical acceptance round by round (rounds, acceptance histogram,
acceptance by position). MUST_FAIL lists mis-parses reported in public trackers; each is applied
to the packaged load and must change acceptance while the output stays exact (the test has power).
"""
import dataclasses
import json
import math

import pytest
import torch

from dspark_rt import Decoder, SamplingParams, testing
from dspark_rt.checkpoint import drafter_formats, drafter_tensors
from dspark_rt.checkpoint.tensors import Checkpoint
from dspark_rt.checkpoint.config import CheckpointError
from dspark_rt.checkpoint.drafter_config import DrafterConfig
from dspark_rt.models.drafter import Drafter
from dspark_rt.policies import ThresholdPolicy
from dspark_rt.policies.sts import read_temperatures
from tests.support import packagings as pk
from tests.support.shipped_pair import DRAFTERS, PROMPTS, TARGET

PROMPTS4 = PROMPTS[:4]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
VANILLA, DFLASH = DRAFTERS["vanilla"], DRAFTERS["none"]
GATED, RNN = DRAFTERS["gated"], DRAFTERS["rnn"]
TEMPS = read_temperatures(VANILLA / "dspark_calibration.json").temperatures
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def _signature(target, drafter, *, policy="fixed", calibration=None, prompts=PROMPTS4):
    """Per request: tokens, rounds, acceptance histogram and acceptance by position."""
    dec = Decoder.from_pretrained(target, drafter, dtype="float64", policy=policy,
                                  calibration=calibration)
    outs = dec.generate(prompts, PARAMS, use_tqdm=False)
    return [(o.token_ids, o.metrics.num_rounds, tuple(o.metrics.acceptance_histogram),
             tuple(o.metrics.accepted_by_position)) for o in outs]


def _draft_ids():
    """A reduced draft vocabulary: every token plain decoding of the prompts needs, plus every
    other id of the rest (so the vocabulary map matters)."""
    dec = Decoder.from_pretrained(TARGET, mode="ar", dtype="float64")
    used = {t for o in dec.generate(PROMPTS4, PARAMS, use_tqdm=False) for t in o.token_ids}
    used |= {t for p in PROMPTS4 for t in dec.tokenizer.encode(p)}
    V = dec.target.config.vocab_size
    return sorted(used | set(range(0, V, 2)))


# name -> builder(tmp) returning (packaged dir, canonical dir, decoder kwargs); kwargs may hold
# "packaged" / "canonical" overrides.
def _deepspec_stock(tmp):
    return pk.deepspec_stock(VANILLA, tmp / "p", TARGET), VANILLA, {}


def _deepspec_dflash_stock(tmp):
    return pk.deepspec_stock(DFLASH, tmp / "p", TARGET), DFLASH, {}


def _forked(tmp):
    return pk.forked_label(VANILLA, tmp / "p"), VANILLA, {}


def _speculators(tmp):
    return pk.speculators(VANILLA, tmp / "p", TARGET), VANILLA, {}


def _speculators_legacy(tmp):
    return pk.speculators(VANILLA, tmp / "p", TARGET, legacy=True), VANILLA, {}


def _speculators_legacy_1n(tmp):
    canon = pk.with_fields(VANILLA, tmp / "c", dspark_bonus_anchor=True)
    return pk.speculators(canon, tmp / "p", TARGET, legacy=True), canon, {}


def _speculators_draft_vocab(tmp):
    ids = _draft_ids()
    canon = pk.masked_vocab_canonical(VANILLA, tmp / "c", ids)
    return pk.speculators(VANILLA, tmp / "p", TARGET, draft_ids=ids), canon, {}


def _speculators_dflash_draft_vocab(tmp):
    ids = _draft_ids()
    canon = pk.masked_vocab_canonical(DFLASH, tmp / "c", ids)
    return pk.speculators(DFLASH, tmp / "p", TARGET, draft_ids=ids), canon, {}


# SpecForge: DeepSpec-trained drafters as SpecForge's own exporter writes them (tests/support/packagings.py
# specforge, checked field for field against specforge/export/to_hf.py's output); canonical: the
# same drafter in DeepSpec's layout
def _specforge(tmp, drafter=VANILLA, **kw):
    return pk.specforge(drafter, tmp / "p", **kw), drafter, {}


def _specforge_sglang(tmp, drafter=VANILLA):
    return pk.specforge_sglang(drafter, tmp / "p"), drafter, {}


def _specforge_yarn(tmp):
    canon = pk.with_fields(VANILLA, tmp / "c", rope_scaling=YARN)
    return pk.specforge(canon, tmp / "p", rope_scaling=YARN), canon, {}


def _zlab(tmp):
    canon = pk.with_fields(DFLASH, tmp / "c", dspark_bonus_anchor=True)
    return pk.zlab(DFLASH, tmp / "p"), canon, {}


def _zlab_sliding(tmp):
    # canonical: the older z-lab layout stating its causality (is_causal) on full layers
    canon = pk.with_fields(pk.zlab(DFLASH, tmp / "z"), tmp / "c", is_causal=True)
    return pk.zlab(DFLASH, tmp / "p", sliding_window=512), canon, {}


def _sts_in_config(tmp):
    pkg = pk.with_fields(VANILLA, tmp / "p", sts_temperatures=list(TEMPS))
    shipped = list(DrafterConfig.from_json(pkg).sts_temperatures)
    return pkg, VANILLA, {"policy": ThresholdPolicy(0.7), "packaged": {"calibration": shipped},
                          "canonical": {"calibration": list(TEMPS)}}


def _conf_without_bias(tmp):
    pkg, canon = pk.conf_without_bias(VANILLA, tmp)
    return pkg, canon, {"policy": ThresholdPolicy(0.7)}


def _interleaved(tmp):
    return pk.interleaved(DFLASH, tmp / "p"), DFLASH, {}


CASES = {"deepspec-stock": _deepspec_stock, "deepspec-dflash-stock": _deepspec_dflash_stock,
         "forked-label": _forked, "speculators": _speculators,
         "speculators-legacy": _speculators_legacy, "speculators-legacy-1+N": _speculators_legacy_1n,
         "speculators-draft-vocab": _speculators_draft_vocab,
         "speculators-dflash-draft-vocab": _speculators_dflash_draft_vocab, "specforge": _specforge,
         "specforge-gated": lambda tmp: _specforge(tmp, GATED),
         "specforge-rnn": lambda tmp: _specforge(tmp, RNN),
         "specforge-dflash": lambda tmp: _specforge(tmp, DFLASH),
         "specforge-dflash-defaults": lambda tmp: _specforge(tmp, DFLASH, minimal=True),
         "specforge-sglang": _specforge_sglang,
         "specforge-sglang-rnn": lambda tmp: _specforge_sglang(tmp, RNN),
         "specforge-yarn": _specforge_yarn, "zlab-nested": _zlab, "zlab-sliding": _zlab_sliding,
         "sts-in-config": _sts_in_config, "conf-without-bias": _conf_without_bias,
         "rope-interleaved": _interleaved}


@pytest.fixture(scope="module")
def plain():
    dec = Decoder.from_pretrained(TARGET, mode="ar", dtype="float64")
    return [o.token_ids for o in dec.generate(PROMPTS4, PARAMS, use_tqdm=False)]


def _run_case(name, tmp):
    pkg, canon, kw = CASES[name](tmp)
    kw = dict(kw)
    mine, theirs = kw.pop("packaged", {}), kw.pop("canonical", {})
    return (lambda: _signature(TARGET, pkg, **kw, **mine)), _signature(TARGET, canon, **kw, **theirs)


@pytest.mark.parametrize("name", list(CASES))
def test_packaging_decodes_like_its_canonical_layout(tmp_path, plain, name):
    packaged, canonical = _run_case(name, tmp_path)
    got = packaged()
    assert [s[0] for s in got] == plain, "output must equal plain decoding"
    assert [s[0] for s in canonical] == plain
    assert got == canonical, f"{name}: acceptance differs from the canonical layout"
    rounds = sum(s[1] for s in got)
    print(f"{name}: {rounds} rounds for {sum(len(s[0]) for s in got)} tokens")


# -- mis-parses that keep the output exact: each must change acceptance ------------------------

def _config_patch(monkeypatch, packaging, fn):
    real = DrafterConfig.from_dict.__func__

    def patched(cls, d, src="config.json", allow_dflash2=False):
        out = real(cls, d, src, allow_dflash2)
        return fn(out) if out.format == packaging else out
    monkeypatch.setattr(DrafterConfig, "from_dict", classmethod(patched))


def _partial_rotary(monkeypatch):
    """Honours the inherited partial_rotary_factor 0.25: only a quarter of each head rotates."""
    real = Drafter.from_tensors.__func__

    def patched(cls, dcfg, tensors, target):
        model = real(cls, dcfg, tensors, target)
        rot = model.rotary
        keep = rot.inv_freq.clone()
        keep[len(keep) // 4:] = 0  # frequency 0: cos 1, sin 0, no rotation
        rot.inv_freq = keep
        return model
    monkeypatch.setattr(Drafter, "from_tensors", classmethod(patched))


def _d2t_ignored(monkeypatch):
    """Draft id d read as target id d (d2t offsets dropped; t2d and lm_head checks bypassed)."""
    real = Checkpoint.load_index_tensor

    def identity_map(self, n, shape, dev):
        t = real(self, n, shape, dev)
        if n == "d2t":
            return torch.zeros_like(t)
        out = torch.zeros_like(t)  # t2d: as many draft ids, moved onto ids 0 .. V_draft - 1
        out[:int(t.sum())] = 1
        return out
    monkeypatch.setattr(Checkpoint, "load_index_tensor", identity_map)
    monkeypatch.setattr(drafter_tensors, "_same", lambda a, b, stored=None: True)


MUST_FAIL = {
    "anchor-slot-misread": ("speculators", lambda mp: _config_patch(
        mp, "speculators", lambda c: dataclasses.replace(c, block_layout="one_plus_n"))),
    "aux-ids-one-layer-off": ("speculators", lambda mp: _config_patch(
        mp, "speculators", lambda c: dataclasses.replace(
            c, target_layer_ids=tuple(i - 1 for i in c.target_layer_ids)))),
    "partial-rotary-honoured": ("deepspec-stock", _partial_rotary),
    "d2t-ignored": ("speculators-draft-vocab", _d2t_ignored),
    "specforge-anchor-slot-misread": ("specforge", lambda mp: _config_patch(
        mp, "specforge", lambda c: dataclasses.replace(c, block_layout="one_plus_n"))),
    "specforge-dflash-anchor-slot-misread": ("specforge-dflash", lambda mp: _config_patch(
        mp, "specforge", lambda c: dataclasses.replace(c, block_layout="one_plus_n"))),
    "yarn-ignored": ("specforge-yarn", lambda mp: _config_patch(
        mp, "specforge", lambda c: dataclasses.replace(
            c, model=dataclasses.replace(c.model, rope_scaling=None)))),
    "sliding-read-bidirectional": ("zlab-sliding", lambda mp: _config_patch(
        mp, "zlab", lambda c: dataclasses.replace(c, causal_layers=(False,) * len(c.causal_layers)))),
    "interleave-ignored": ("rope-interleaved", lambda mp: _config_patch(
        mp, "deepspec", lambda c: dataclasses.replace(c, rope_interleave=False))),
    "sts-ignored": ("sts-in-config", lambda mp: _config_patch(
        mp, "deepspec", lambda c: dataclasses.replace(c, sts_temperatures=None))),
}


@pytest.mark.parametrize("mutant", list(MUST_FAIL))
def test_misparse_keeps_output_but_is_caught(tmp_path, plain, monkeypatch, mutant):
    """Must-fail check: the mis-parse is applied to the packaged load; tokens stay exact and the
    acceptance comparison above must see the difference."""
    case, apply = MUST_FAIL[mutant]
    packaged, canonical = _run_case(case, tmp_path)
    apply(monkeypatch)
    if mutant == "sts-ignored":  # the temperatures reach the Decoder through the parsed config
        pkg = tmp_path / "p"
        got = _signature(TARGET, pkg, policy=ThresholdPolicy(0.7),
                         calibration=DrafterConfig.from_json(pkg).sts_temperatures)
    else:
        got = packaged()
    assert [s[0] for s in got] == plain, "the mis-parse must keep the output exact"
    assert got != canonical, f"{mutant}: acceptance unchanged, the comparison has no power"


# -- loud failures: what cannot be served exactly names its field ------------------------------

def _cfg(path):
    return json.loads((path / "config.json").read_text())


def _edit(path, **changes):
    cfg = _cfg(path)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _load(path):
    from dspark_rt.models.qwen3 import Qwen3Model
    return Drafter.from_pretrained(str(path), Qwen3Model.from_pretrained(TARGET, dtype="float32"))


def test_specforge_head_defaults(tmp_path):
    """Head fields a SpecForge draft config leaves out read as SpecForge builds the model
    (modeling/draft/dspark.py: no Markov head, a confidence head iff confidence_head_alpha > 0,
    without the Markov feature), in the anchor-first block its DSpark objective trains."""
    p = pk.specforge(DFLASH, tmp_path / "p", minimal=True)
    got = DrafterConfig.from_json(p)
    assert (got.markov_rank, got.head, got.confidence, got.layout, got.gamma) == \
        (0, "none", False, "anchor_first", _cfg(p)["block_size"])
    cfg = _cfg(p)
    cfg["dflash_config"].update(confidence_head_alpha=1.0, markov_rank=8)
    (p / "config.json").write_text(json.dumps(cfg))
    got = DrafterConfig.from_json(p)
    assert (got.markov_rank, got.head, got.confidence, got.confidence_markov) == \
        (8, "vanilla", True, False)
    cfg["dflash_config"].update(projector_type="dflash", markov_rank=0, confidence_head_alpha=0.0)
    (p / "config.json").write_text(json.dumps(cfg))
    assert DrafterConfig.from_json(p).layout == "one_plus_n"  # SpecForge's DFlash objective
    cfg["dflash_config"]["markov_rank"] = 8
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'dflash_config.projector_type' = 'dflash' names a "
                                              "DFlash drafter"):
        DrafterConfig.from_json(p)


def test_dflash2_loads_through_its_own_door(tmp_path):
    """A DFlash2 config loads only as a DFlash2Drafter (models.load.load_drafter, what
    Decoder.from_pretrained uses), and only in z-lab's packaging."""
    p = pk.zlab(DFLASH, tmp_path / "p")
    cfg = _cfg(p)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                selector_top_k=16)
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"DFlash2DraftModel.*loads through models.load"):
        _load(p)
    cfg["architectures"] = ["DFlashDraftModel"]  # relabelled: the fields still say DFlash2
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"conv_kernel_size.*loads through models.load"):
        _load(p)
    cfg["dflash_config"]["selector_top_k"] = cfg["vocab_size"] + 1
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"field 'selector_top_k' = \d+ exceeds vocab_size"):
        DrafterConfig.from_json(p, allow_dflash2=True)
    cfg["dflash_config"]["selector_top_k"] = 16
    nested = cfg.pop("dflash_config")
    flat = {**cfg, **nested, "speculators_model_type": "dflash2"}
    (p / "config.json").write_text(json.dumps(flat))
    with pytest.raises(CheckpointError, match=r"z-lab's packaging .* only"):
        DrafterConfig.from_json(p, allow_dflash2=True)


@pytest.mark.parametrize("edit,msg", [
    (dict(sample_from_anchor=None, speculators_config=None),
     r"neither field 'sample_from_anchor' nor .*speculative_tokens"),
    (dict(sample_from_anchor=False), r"'sample_from_anchor' contradicts 'speculative_tokens'"),
    (dict(speculators_model_type="eagle3"), r"field 'speculators_model_type' = 'eagle3'"),
    (dict(target_hidden_size=512), r"field 'target_hidden_size' = 512"),
    (dict(projector_type="domino"), r"field 'projector_type' = 'domino'"),
])
def test_speculators_errors_name_the_field(tmp_path, edit, msg):
    p = pk.speculators(VANILLA, tmp_path / "p", TARGET)
    _edit(tmp_path / "p", **edit)
    with pytest.raises(CheckpointError, match=msg):
        _load(p)


def test_speculators_sliding_layers_need_their_causality(tmp_path):
    p = pk.speculators(DFLASH, tmp_path / "p", TARGET)
    cfg = _cfg(tmp_path / "p")
    cfg["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=512)
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"field 'sliding_window_non_causal' is missing"):
        _load(p)
    _edit(tmp_path / "p", sliding_window_non_causal=False)
    assert DrafterConfig.from_json(p).causal_layers == (True,)


def test_binding_sliding_window_is_served(tmp_path, plain):
    """A window that binds (8 positions; prompts are longer) is applied, not dropped: the
    output stays exact and the acceptance moves away from the same drafter without a window
    (the backbone's windowed attention is held to z-lab's mask in the DFlash2 test below)."""
    wide = _signature(TARGET, pk.zlab(DFLASH, tmp_path / "wide", sliding_window=512))
    narrow = _signature(TARGET, pk.zlab(DFLASH, tmp_path / "narrow", sliding_window=8))
    assert [s[0] for s in narrow] == plain == [s[0] for s in wide]
    assert [s[1:] for s in narrow] != [s[1:] for s in wide]


def test_capped_logits_are_refused(tmp_path):
    p = pk.zlab(DFLASH, tmp_path / "p")
    cfg = _cfg(tmp_path / "p")
    cfg["dflash_config"]["final_logit_softcapping"] = 20.0
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"field 'final_logit_softcapping' = 20.0"):
        _load(p)


def test_copies_of_target_tensors_must_match(tmp_path):
    """Tied target: the drafter's LM-head copy is the target's embedding; a different one (a
    drafter trained against another head) is refused, not silently replaced."""
    from safetensors.torch import load_file, save_file
    p = pk.deepspec_stock(VANILLA, tmp_path / "p", TARGET)
    _load(p)  # the copies equal the tied embedding
    t = load_file(tmp_path / "p" / "model.safetensors")
    t["lm_head.weight"] = t["lm_head.weight"] * 1.01
    save_file(t, tmp_path / "p" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head\.weight' differs from the target"):
        _load(p)


def test_low_precision_copies_are_copies(tmp_path):
    """A bf16 copy of an fp32 target's embedding / LM head is compared at bf16 precision."""
    from safetensors.torch import load_file, save_file
    from dspark_rt.models.qwen3 import Qwen3Model
    tdir = testing.write_tiny_target(tmp_path / "t", vocab=96, hidden=32, layers=3, heads=4,
                                     kv_heads=2, head_dim=8, dtype="float32")
    testing.write_tiny_drafter(tmp_path / "d", tdir, head="vanilla", markov_rank=8,
                               target_layer_ids=[-1, 1])
    st = tmp_path / "d" / "model.safetensors"
    t = load_file(st)
    save_file({k: v.to(torch.bfloat16) if k in ("lm_head.weight", "embed_tokens.weight") else v
               for k, v in t.items()}, st)
    Drafter.from_pretrained(str(tmp_path / "d"), Qwen3Model.from_pretrained(tdir, dtype="float64"))


def test_draft_vocabulary_checks(tmp_path):
    from safetensors.torch import load_file, save_file
    ids = list(range(0, 2048, 2))
    p = pk.speculators(VANILLA, tmp_path / "p", TARGET, draft_ids=ids)
    st = tmp_path / "p" / "model.safetensors"
    good = load_file(st)
    t = dict(good, t2d=torch.roll(good["t2d"], 1))
    save_file(t, st)
    with pytest.raises(CheckpointError, match=r"'t2d' and 'd2t' disagree.*draft_vocab_size=1024"):
        _load(p)
    t = dict(good, **{"lm_head.weight": good["lm_head.weight"] + 1})
    save_file(t, st)
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' \(draft vocabulary, "
                                              r"draft_vocab_size=1024\)"):
        _load(p)
    t = {k: v for k, v in good.items() if k != "d2t"}
    save_file(t, st)
    with pytest.raises(CheckpointError, match=r"tensor 'd2t' is missing"):
        _load(p)


# -- pieces checked against their definitions ---------------------------------------------------

def test_class_defaults_match_transformers():
    """The defaults speculators' to_diff_dict leaves out, against transformers' own classes."""
    import transformers
    for kind, cls in (("qwen3", transformers.Qwen3Config), ("llama", transformers.LlamaConfig)):
        ref = cls().to_dict()
        ref["rope_theta"] = ref["rope_parameters"]["rope_theta"]
        for k, v in drafter_formats._CLASS_DEFAULTS[kind].items():
            assert ref[k] == v, (kind, k, ref[k], v)


def test_yarn_rotary_matches_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from dspark_rt.checkpoint.config import TargetConfig
    from dspark_rt.models.drafter import YarnRotary
    for extra in ({}, {"mscale": 1.0, "mscale_all_dim": 0.5}, {"attention_factor": 1.3,
                                                               "beta_fast": 16.0}):
        rp = {**YARN, "rope_theta": 1e4, **extra}
        hf = transformers.Qwen3Config(hidden_size=256, num_attention_heads=4, head_dim=64,
                                      max_position_embeddings=512, rope_parameters=rp)
        inv, att = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        cfg = TargetConfig.from_dict({"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
                                      "num_hidden_layers": 1, "intermediate_size": 8,
                                      "vocab_size": 8, "rope_theta": 1e4,
                                      "rope_scaling": {**YARN, **extra}},
                                     arch="qwen3", drafter=True)
        mine = YarnRotary(cfg, torch.float64, "cpu")
        assert math.isclose(mine.attention_factor, att, rel_tol=1e-12)
        assert torch.allclose(mine.inv_freq.float(), inv, rtol=1e-6, atol=0)  # float32 reference


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", "none"])
def test_draft_vocabulary_proposal_equals_reference(tmp_path, head):
    """For every head type, the expanded head gives exactly the reference proposal: softmax over
    the draft vocabulary of lm_head_draft(h) + bias_draft (speculators MarkovHead.block_bias),
    placed at target ids draft id + d2t, zero elsewhere."""
    from dspark_rt import ops
    from dspark_rt.models.qwen3 import Qwen3Model
    tdir = testing.write_tiny_target(tmp_path / "t", vocab=96, hidden=32, layers=3, heads=4,
                                     kv_heads=2, head_dim=8)
    testing.write_tiny_drafter(tmp_path / "c", tdir, head=head, markov_rank=8, block_size=4,
                               target_layer_ids=[-1, 1])
    ids = sorted(set(range(0, 96, 3)) | {5, 7})
    pk.speculators(tmp_path / "c", tmp_path / "p", tdir, draft_ids=ids)
    target = Qwen3Model.from_pretrained(tdir, dtype="float64")
    d = Drafter.from_pretrained(str(tmp_path / "p"), target)
    ref = {k: v.double() for k, v in pk.read(tmp_path / "p")[1].items() if v.is_floating_point()}
    g = torch.Generator().manual_seed(0)
    R, gamma, D, V = 3, 4, 32, 96
    h = torch.randn(R, gamma, D, generator=g, dtype=torch.float64)
    anchor = torch.tensor([5, 7, 0])
    U = target.lm_head(h.reshape(-1, D)).view(R, gamma, V).double()
    w = {k: getattr(d, k) for k in ("w1", "w2", "gate_w", "gate_b", "joint_w", "joint_b")}
    w = {k: None if v is None else v.double() for k, v in w.items()}
    z = U.clone()
    tokens, _, lse, _ = ops.markov_sample(z, h, anchor, d.head, **w,
                                          temperature=torch.zeros(R), seed=torch.zeros(R, dtype=torch.int64),
                                          stream=torch.zeros(R, dtype=torch.int64),
                                          round_=torch.zeros(R, dtype=torch.int64))
    # reference, draft vocabulary, transcribed from speculators' MarkovHead
    idx = torch.tensor(ids)
    prev, s = anchor, torch.zeros(R, 8, dtype=torch.float64)
    for k in range(gamma):
        base = h[:, k] @ ref["lm_head.weight"].T
        if head == "none":
            bias = torch.zeros_like(base)
        else:
            e = ref["markov_head.markov_w1.weight"][prev]
            if head == "gated":
                gate = torch.sigmoid(torch.cat([h[:, k], e], -1) @ ref["markov_head.gate_proj.weight"].T
                                     + ref["markov_head.gate_proj.bias"])
                e = gate * e
            elif head == "rnn":
                zz = torch.cat([s, e, h[:, k]], -1) @ ref["markov_head.joint_proj.weight"].T \
                    + ref["markov_head.joint_proj.bias"]
                gr, cr, orw = zz.chunk(3, -1)
                gt = torch.sigmoid(gr)
                s = gt * s + (1 - gt) * torch.tanh(cr)
                e = torch.tanh(orw)
            bias = e @ ref["markov_head.markov_w2.weight"].T
        want = torch.full((R, V), float("-inf"), dtype=torch.float64)
        want[:, idx] = base + bias
        assert torch.allclose(torch.softmax(z[:, k], -1), torch.softmax(want, -1), atol=1e-12)
        assert torch.equal(tokens[:, k], want.argmax(-1))
        prev = tokens[:, k]


def test_llama_target_speculators_layout(tmp_path):
    """A Llama-family target with a speculators drafter whose transformer_layer_config is a
    LlamaConfig diff (defaults left out): same drafter as its DeepSpec layout."""
    tdir = testing.write_tiny_target(tmp_path / "t", arch="llama", vocab=320, hidden=64, layers=3,
                                     heads=4, kv_heads=2, logit_scale=3.0)
    canon = testing.write_tiny_drafter(tmp_path / "c", tdir, head="vanilla", markov_rank=16,
                                       block_size=4, target_layer_ids=[-1, 1],
                                       share_target_layers=True)
    pkg = pk.speculators(canon, tmp_path / "p", tdir, model_type="llama")
    tl = pk.read(pkg)[0]["transformer_layer_config"]
    assert tl["model_type"] == "llama" and not {"rms_norm_eps", "rope_theta", "hidden_act"} & set(tl)
    prompts = ["The quick brown fox jumps", "def add(a, b):\n", "Numbers: 0 1 2 3"]
    plain = [o.token_ids for o in Decoder.from_pretrained(tdir, mode="ar", dtype="float64")
             .generate(prompts, PARAMS, use_tqdm=False)]
    got, want = (_signature(tdir, p, prompts=prompts) for p in (pkg, canon))
    assert [s[0] for s in got] == plain and got == want
    assert sum(s[1] for s in got) < sum(len(s[0]) for s in got), "some drafts must be accepted"


def test_speculators_layer_config_is_written_without_defaults(tmp_path):
    tl = pk.read(pk.speculators(VANILLA, tmp_path / "p", TARGET))[0]["transformer_layer_config"]
    assert not {"rms_norm_eps", "rope_theta", "hidden_act", "attention_bias"} & set(tl)
    cfg = DrafterConfig.from_json(tmp_path / "p")
    assert (cfg.model.rms_norm_eps, cfg.model.rope_theta) == (1e-6, 10000.0)
    assert cfg.target_layer_ids == DrafterConfig.from_json(VANILLA).target_layer_ids


# -- DFlash2: backbone and proposal against their reference (tests/models/test_dflash2.py: served) --

def _dflash2_dense(w, emb, c, feats, block_ids, n_ctx, window=None):
    """z-lab DFlash2DraftModel.forward for one request, transcribed densely from
    dflash/model.py: context K/V from hidden_norm(fc(features)), every sublayer wrapped in the
    grouped dynamic causal convolution over the block, bidirectional attention (is_causal false)
    masked as its _attention_mask does for a sliding window: query position p sees key position
    j iff p - j < window and j - p < window."""
    dc = c["dflash_config"]
    d, hq, hkv, hd, eps, theta = (c["hidden_size"], c["num_attention_heads"],
                                  c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"],
                                  c["rope_theta"])
    K, gs = dc["conv_kernel_size"], dc["conv_group_size"]

    def rms(x, wt):
        return wt * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = pos.double()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def conv(x, dyn, base):  # _grouped_dynamic_convolve, one sequence
        L = x.shape[0]
        blocks, out = x.view(L, d // gs, gs), torch.zeros(L, d // gs, gs, dtype=x.dtype)
        for o in range(K):
            vals = blocks if o == 0 else torch.cat([torch.zeros(o, d // gs, gs, dtype=x.dtype),
                                                    blocks[:-o]])
            out = out + base[o].view(d // gs, gs) * vals + dyn[:, o][..., None] * vals
        return out.view(L, d)

    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = emb[block_ids]
    B = len(block_ids)
    cpos, bpos = torch.arange(n_ctx), torch.arange(n_ctx, n_ctx + B)
    for i in range(c["num_hidden_layers"]):
        p = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731

        def wrapped(x, name, sub):
            dyn = (x @ p(f"{name}.kernel_projection.weight").T).view(B, 2, K, d // gs)
            y = sub(conv(x, dyn[:, 0], p(f"{name}.base_kernel")[0]))
            return conv(y, dyn[:, 1], p(f"{name}.base_kernel")[1])

        def attn(x):
            q = rope(rms((x @ p("self_attn.q_proj.weight").T).view(B, hq, hd),
                         p("self_attn.q_norm.weight")), bpos)
            src = torch.cat([ctx, x])
            k = rope(rms((src @ p("self_attn.k_proj.weight").T).view(-1, hkv, hd),
                         p("self_attn.k_norm.weight")), torch.cat([cpos, bpos]))
            v = (src @ p("self_attn.v_proj.weight").T).view(-1, hkv, hd)
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
            if window is not None:
                kp = torch.cat([cpos, bpos])
                far = (bpos[:, None] - kp[None] >= window) | (kp[None] - bpos[:, None] >= window)
                s = s.masked_fill(far, float("-inf"))
            a = torch.softmax(s, -1)
            return torch.einsum("hqk,khd->qhd", a, v).reshape(B, hq * hd) @ p("self_attn.o_proj.weight").T

        def mlp(x):
            return (torch.nn.functional.silu(x @ p("mlp.gate_proj.weight").T)
                    * (x @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T

        h = h + wrapped(rms(h, p("input_layernorm.weight")), "attention_conv", attn)
        h = h + wrapped(rms(h, p("post_attention_layernorm.weight")), "mlp_conv", mlp)
    return rms(h, w["norm.weight"])


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    from dspark_rt.models.dflash2 import DFlash2Drafter
    from dspark_rt.models.qwen3 import Qwen3Model
    tmp = tmp_path_factory.mktemp("dflash2")
    tdir = testing.write_tiny_target(tmp / "t", vocab=96, hidden=32, layers=3, heads=4,
                                     kv_heads=2, head_dim=8, seed=3)
    ddir = pk.dflash2(tmp, tdir)
    target = Qwen3Model.from_pretrained(tdir, dtype="float64")
    return tdir, ddir, target, DFlash2Drafter.from_pretrained(str(ddir), target)


@pytest.mark.parametrize("window", [None, 4])
def test_dflash2_backbone_matches_reference(dflash2_pair, tmp_path, window):
    """window 4 binds: 6 context positions and a block of 5, so every block position loses
    context keys and the first ones lose block keys too."""
    from dspark_rt.models.batch import AttnMeta
    from dspark_rt.models.dflash2 import DFlash2Drafter
    tdir, ddir, target, dr = dflash2_pair
    with pytest.raises(CheckpointError, match="DFlash2DraftModel"):
        Drafter.from_pretrained(str(ddir), target)  # the plain drafter class refuses it by name
    if window is not None:
        ddir = pk.with_fields(ddir, tmp_path / "w", sliding_window=window)
        dr = DFlash2Drafter.from_pretrained(str(ddir), target)
    c, w = pk.read(ddir)
    w = {k: v.double() for k, v in w.items()}
    emb = pk.read(tdir)[1]["model.embed_tokens.weight"].double()
    B, n_ctx, page = c["dflash_config"]["block_size"], 6, 4
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, n_ctx, 2 * 32, generator=g, dtype=torch.float64)
    ids = torch.full((2, B), c["dflash_config"]["mask_token_id"])
    ids[:, 0] = torch.tensor([5, 17])
    pages = (n_ctx + B + page - 1) // page
    cache = dr.make_cache(2 * pages, page)
    tables = torch.arange(2 * pages, dtype=torch.int32).view(2, pages)

    def slots(r, pos):
        return tables[r, pos // page].long() * page + pos % page
    for r in range(2):
        pos = torch.arange(n_ctx)
        dr.context_update(feats[r], pos, slots(r, pos), cache)
    bpos = torch.arange(n_ctx, n_ctx + B)
    meta = AttnMeta(cu_q=torch.tensor([0, B, 2 * B], dtype=torch.int32),
                    kv_lens=torch.tensor([n_ctx + B] * 2, dtype=torch.int32), block_tables=tables,
                    slot_mapping=torch.cat([slots(0, bpos), slots(1, bpos)]), causal=False)
    hidden = dr.forward_block(ids.reshape(-1), torch.cat([bpos, bpos]), meta, cache)
    for r in range(2):
        want = _dflash2_dense(w, emb, c, feats[r], ids[r], n_ctx, window)
        assert torch.allclose(hidden[r * B:(r + 1) * B], want, rtol=1e-10, atol=1e-12)


def test_dflash2_proposal_is_a_topk_masked_bilinear_head(dflash2_pair):
    """The reference proposal (CandidateSelector.select) equals, position by position, the
    full-vocabulary form a round would use: S = U + <A[prev] * H h, B[b]> on the top-k of U,
    -inf elsewhere; greedy takes its argmax, T > 0 samples softmax(S / T). And the acceptance
    rule with that q (candidates scattered) emits exactly the target's law."""
    _, ddir, target, dr = dflash2_pair
    c = pk.read(ddir)[0]["dflash_config"]
    g = torch.Generator().manual_seed(4)
    h = torch.randn(3, c["block_size"] - 1, 32, generator=g, dtype=torch.float64)
    anchor = torch.tensor([1, 50, 95])
    sel = dr.candidate_selector
    for T in (0.0, 0.8):
        tokens, cand, q = dr.propose(h, anchor, T, generator=torch.Generator().manual_seed(0))
        prev = anchor
        for t in range(h.shape[1]):
            u = torch.tanh(target.lm_head(h[:, t]) * c["output_multiplier"]
                           / c["final_logit_softcapping"]) * c["final_logit_softcapping"]
            bias = (sel.predecessor_codebook.weight[prev] * (h[:, t] @ sel.hidden_projection.weight.T)) \
                @ sel.successor_codebook.weight.T
            top = u.topk(c["selector_top_k"], -1).indices
            S = torch.full_like(u, float("-inf")).scatter(-1, top, (u + bias).gather(-1, top))
            assert set(cand[:, t].flatten().tolist()) <= set(top.flatten().tolist())
            if T == 0:
                assert torch.equal(tokens[:, t], S.argmax(-1))
            else:
                full = torch.zeros_like(u).scatter(-1, cand[:, t], q[:, t])
                assert torch.allclose(full, torch.softmax(S / T, -1), atol=1e-12)
            prev = tokens[:, t]
    # lossless acceptance against a proposal supported on the candidates (z-lab _rejection_sample)
    P = torch.softmax(torch.randn(96, generator=g, dtype=torch.float64), -1)
    qfull = torch.zeros(96, dtype=torch.float64).scatter(0, cand[0, 0], q[0, 0])
    emitted = torch.minimum(qfull, P) + (1 - torch.minimum(qfull, P).sum()) * \
        (P - qfull).clamp_min(0) / (P - qfull).clamp_min(0).sum()
    assert torch.allclose(emitted, P, atol=1e-12)


def test_layer_kinds_follow_transformers_when_layer_types_is_absent(tmp_path):
    """No layer_types: Qwen3Config's rule (sliding from max_window_layers on when
    use_sliding_window) decides, so an inherited sliding window is not silently dropped."""
    p = pk.zlab(DFLASH, tmp_path / "p")
    cfg = _cfg(p)
    cfg.pop("layer_types", None)
    cfg.update(use_sliding_window=True, sliding_window=4096, max_window_layers=0)
    (p / "config.json").write_text(json.dumps(cfg))
    assert DrafterConfig.from_json(p).causal_layers == (True,)  # z-lab: sliding layers are causal
    cfg["max_window_layers"] = 1
    (p / "config.json").write_text(json.dumps(cfg))
    assert DrafterConfig.from_json(p).causal_layers == (False,)
