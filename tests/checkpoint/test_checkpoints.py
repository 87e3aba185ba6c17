"""Checkpoint directories: every supported format loads, every malformed one fails early with a
CheckpointError naming the file and the tensor or field; the tokenizer and its chat template."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_rt import testing
from dspark_rt.checkpoint.tensors import Checkpoint
from dspark_rt.checkpoint.config import CheckpointError, TargetConfig
from dspark_rt.checkpoint.drafter_config import DrafterConfig
from dspark_rt.models.drafter import Drafter
from dspark_rt.models.qwen3 import Qwen3Model
from dspark_rt.checkpoint.tokenizer import ChatTemplateError, Tokenizer

SIZES = dict(vocab=96, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8)
D, L, V, RANK = SIZES["hidden"], SIZES["layers"], SIZES["vocab"], 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return testing.write_tiny_target(tmp_path_factory.mktemp("t"), **SIZES)


@pytest.fixture(scope="module")
def target(target_dir):
    return Qwen3Model.from_pretrained(target_dir)


def _edit_json(path, **changes):
    cfg = json.loads(open(path).read())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)


def _edit_tensors(path, drop=(), **replace):
    t = load_file(path)
    for k in drop:
        del t[k]
    t.update(replace)
    save_file(t, path)


# -- formats that load --------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(arch="qwen3"), dict(arch="llama", head_dim=None),
                                dict(arch="qwen3", sharded=True), dict(arch="llama", tie=True)],
                         ids=["qwen3", "llama", "sharded", "tied"])
def test_target_formats_load(tmp_path, kw):
    path = testing.write_tiny_target(tmp_path, **{**SIZES, **kw})
    cfg = json.loads((tmp_path / "config.json").read_text())
    if kw["arch"] == "llama":
        assert "head_dim" not in cfg  # Llama derives it: hidden / heads
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(kw.get("sharded"))
    m = Qwen3Model.from_pretrained(path, dtype="bfloat16")
    assert m.config.arch == kw["arch"] and m.config.qk_norm == (kw["arch"] == "qwen3")
    assert m.config.head_dim == D // SIZES["heads"] and len(m.layers) == L
    assert m.dtype == torch.bfloat16 and (m.lm_head_weight is None) == bool(kw.get("tie"))
    assert (m.layers[0].self_attn.q_norm is None) == (kw["arch"] == "llama")
    assert m.lm_head(torch.zeros(2, D, dtype=torch.bfloat16)).dtype == torch.float32
    assert m.config.eos_token_ids == (Tokenizer(path).eos_token_id,)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", "none"])
@pytest.mark.parametrize("conf", [(True, True), (True, False), (False, False)],
                         ids=["conf-markov", "conf", "no-conf"])
def test_deepspec_drafters_load(tmp_path, target_dir, target, head, conf):
    testing.write_tiny_drafter(tmp_path, target_dir, head=head, markov_rank=RANK, block_size=5,
                               target_layer_ids=[-1, 1], confidence=conf[0],
                               confidence_markov=conf[1])
    d = Drafter.from_pretrained(tmp_path, target)
    r = 0 if head == "none" else RANK
    assert (d.head, d.layout, d.gamma, d.block_size, d.target_layer_ids) == \
        (head, "anchor_first", 5, 5, [-1, 1])
    assert d.fc.weight.shape == (D, 2 * D) and d.mask_token_id == Tokenizer(target_dir).token_to_id("<|mask|>")
    assert (d.w1 is None) == (head == "none") and (d.w2 is None) == (head == "none")
    if r:
        assert d.w1.shape == d.w2.shape == (V, r)
    assert (d.gate_w is not None) == (head == "gated") and (d.joint_w is not None) == (head == "rnn")
    if head == "gated":
        assert d.gate_w.shape == (r, D + r) and d.gate_b.shape == (r,)
    if head == "rnn":
        assert d.joint_w.shape == (3 * r, 2 * r + D) and d.joint_b.shape == (3 * r,)
    if conf[0]:
        assert d.conf_w.shape == ((D + r,) if conf[1] and r else (D,)) and d.conf_b.shape == (1,)
    else:
        assert d.conf_w is None and d.conf_b is None


def test_zlab_dflash_loads(tmp_path, target_dir, target):
    testing.write_tiny_dflash(tmp_path, target_dir, block_size=6, target_layer_ids=[0, 1])
    assert "embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")
    d = Drafter.from_pretrained(tmp_path, target, dtype=torch.float64)
    assert (d.head, d.layout, d.gamma, d.block_size) == ("none", "one_plus_n", 5, 6)
    assert d.config.format == "zlab" and d.w1 is None and d.conf_w is None
    assert d.dtype == torch.float64


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_transformers_save_pretrained_loads(tmp_path, arch):
    """A directory written by transformers itself (v5: rope_parameters, tied head omitted)."""
    import transformers
    from tests.support.helpers import full_forward_logits
    cls, ccls = {"qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                 "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig)}[arch]
    torch.manual_seed(0)
    hf = cls(ccls(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=5e5,
                  max_position_embeddings=64, tie_word_embeddings=True)).eval()
    hf.save_pretrained(tmp_path)
    m = Qwen3Model.from_pretrained(tmp_path)
    assert (m.config.rope_theta, m.config.tie_word_embeddings, m.config.arch) == (5e5, True, arch)
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([seq])).logits[0]
    got = full_forward_logits(m, seq)
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()  # float32 roundoff, 3 layers deep


def test_extra_tensors_are_ignored_unless_a_layer_beyond_the_config(tmp_path):
    path = testing.write_tiny_target(tmp_path, **SIZES)
    st = str(tmp_path / "model.safetensors")
    _edit_tensors(st, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    Qwen3Model.from_pretrained(path)
    _edit_tensors(st, **{f"model.layers.{L}.mlp.up_proj.weight": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor 'model\.layers\.{L}\."
                                              rf"mlp\.up_proj\.weight' belongs to layer {L}"):
        Qwen3Model.from_pretrained(path)


# -- malformed targets --------------------------------------------------------------------------
def _break_target(tmp_path, sharded=False, **kw):
    path = testing.write_tiny_target(tmp_path, sharded=sharded, **{**SIZES, **kw})
    return path, str(tmp_path / "config.json"), str(tmp_path / "model.safetensors")


def test_missing_tensor(tmp_path):
    path, _, st = _break_target(tmp_path)
    _edit_tensors(st, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor "
                                              r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        Qwen3Model.from_pretrained(path)


def test_missing_tensor_sharded(tmp_path):
    path, _, _ = _break_target(tmp_path, sharded=True)
    shard = str(tmp_path / "model-00002-of-00002.safetensors")
    _edit_tensors(shard, drop=["lm_head.weight"])
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: tensor "
                                              r"'lm_head\.weight' is missing"):
        Qwen3Model.from_pretrained(path)


def test_wrong_shape(tmp_path):
    path, _, st = _break_target(tmp_path)
    _edit_tensors(st, **{"model.layers.2.self_attn.k_proj.weight": torch.zeros(D, 16)})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.2\."
                                              r"self_attn\.k_proj\.weight' has shape \(32, 16\), "
                                              r"expected \(16, 32\)"):
        Qwen3Model.from_pretrained(path)


def test_integer_dtype(tmp_path):
    path, _, st = _break_target(tmp_path)
    _edit_tensors(st, **{"model.norm.weight": torch.ones(D, dtype=torch.int64)})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' "
                                              r"has dtype I64"):
        Qwen3Model.from_pretrained(path)


@pytest.mark.parametrize("field,value,msg", [
    ("hidden_size", None, r"required field 'hidden_size' is missing"),
    ("num_attention_heads", 3, r"num_attention_heads=3 is not a multiple of num_key_value_heads"),
    ("architectures", ["Qwen2ForCausalLM"], r"field 'architectures'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, r"rope_scaling type 'yarn' is not supported"),
    ("attention_bias", True, r"attention_bias"),
    ("vocab_size", "96", r"field 'vocab_size' must be int"),
    ("rms_norm_eps", 0, r"field 'rms_norm_eps' must be a finite number > 0"),
    ("rms_norm_eps", -1e-6, r"field 'rms_norm_eps' must be a finite number > 0"),
    ("eos_token_id", [5, 96], r"field 'eos_token_id' has ids \[96\] outside the vocabulary"),
    ("bos_token_id", 1000, r"field 'bos_token_id' has ids \[1000\] outside the vocabulary"),
])
def test_bad_target_config(tmp_path, field, value, msg):
    path, cfg, _ = _break_target(tmp_path)
    _edit_json(cfg, **{field: value})
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + msg):
        Qwen3Model.from_pretrained(path)


def test_a_folder_with_glob_characters_loads(tmp_path):
    """[ and ] in a path are glob syntax: the shard search must not read them as a pattern."""
    path = testing.write_tiny_target(tmp_path / "run[1] *?", **SIZES)
    assert len(Qwen3Model.from_pretrained(path).layers) == L


def test_no_weights(tmp_path):
    path, _, st = _break_target(tmp_path)
    os.remove(st)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Qwen3Model.from_pretrained(path)


# -- malformed drafters --------------------------------------------------------------------------
def _drafter(tmp_path, target_dir, **kw):
    testing.write_tiny_drafter(tmp_path, target_dir, **{"head": "gated", "markov_rank": RANK, **kw})
    return str(tmp_path / "config.json"), str(tmp_path / "model.safetensors")


@pytest.mark.parametrize("changes,msg", [
    (dict(vocab_size=V + 1), rf"field 'vocab_size' = {V + 1} does not match the target's vocab_size = {V}"),
    (dict(hidden_size=2 * D), rf"field 'hidden_size' = {2 * D} does not match the target's"),
    (dict(target_layer_ids=[0, L - 1]), rf"field 'target_layer_ids' has layer id {L - 1} out of range"),
    (dict(target_layer_ids=[-2]), r"field 'target_layer_ids' has layer id -2 out of range"),
    (dict(markov_head_type="lstm"), r"field 'markov_head_type' = 'lstm' is not a known head type"),
    (dict(markov_head_type=None), r"required field 'markov_head_type' is missing"),
    (dict(mask_token_id=None), r"required field 'mask_token_id' is missing"),
    (dict(block_size=None), r"required field 'block_size' is missing"),
    (dict(num_target_layers=L + 1), rf"field 'num_target_layers' = {L + 1} does not match"),
    (dict(architectures=["Eagle3Model"]), r"field 'architectures'"),
])
def test_bad_drafter_config(tmp_path, target_dir, target, changes, msg):
    cfg, _ = _drafter(tmp_path, target_dir)
    _edit_json(cfg, **changes)
    with pytest.raises(CheckpointError, match=r"config\.json: " + msg):
        Drafter.from_pretrained(tmp_path, target)


def test_zlab_layer_id_checked_against_target(tmp_path, target_dir, target):
    testing.write_tiny_dflash(tmp_path, target_dir, target_layer_ids=[0, L - 1])
    assert DrafterConfig.from_json(tmp_path).num_target_layers is None  # not in z-lab files
    with pytest.raises(CheckpointError, match=rf"config\.json: field 'target_layer_ids' has layer "
                                              rf"id {L - 1} out of range"):
        Drafter.from_pretrained(tmp_path, target)


@pytest.mark.parametrize("edit,msg", [
    (dict(drop=["markov_head.gate_proj.bias"]), r"tensor 'markov_head\.gate_proj\.bias' is missing"),
    (dict(drop=["layers.0.self_attn.k_norm.weight"]), r"tensor 'layers\.0\.self_attn\.k_norm\.weight' is missing"),
    (dict(drop=["confidence_head.proj.weight"]), r"tensor 'confidence_head\.proj\.weight' is missing"),
    ({"markov_head.markov_w1.weight": torch.zeros(V, RANK + 1)},
     rf"tensor 'markov_head\.markov_w1\.weight' has shape \({V}, {RANK + 1}\)"),
    ({"embed_tokens.weight": torch.zeros(V - 1, D)}, r"tensor 'embed_tokens\.weight' has shape"),
    ({"fc.weight": torch.zeros(D, 3 * D, dtype=torch.int32)}, r"tensor 'fc\.weight' has shape"),
    ({"hidden_norm.weight": torch.zeros(D, dtype=torch.int32)}, r"tensor 'hidden_norm\.weight' has dtype I32"),
    ({"layers.1.mlp.up_proj.weight": torch.zeros(2)}, r"tensor 'layers\.1\.mlp\.up_proj\.weight' belongs to layer 1"),
])
def test_bad_drafter_tensors(tmp_path, target_dir, target, edit, msg):
    _, st = _drafter(tmp_path, target_dir)
    drop = edit.pop("drop", ())
    _edit_tensors(st, drop=drop, **edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: " + msg):
        Drafter.from_pretrained(tmp_path, target)


def test_checkpoint_reads_headers_only(tmp_path, target_dir):
    ck = Checkpoint(target_dir)
    f, shape, dt = ck.entries["model.embed_tokens.weight"]
    assert f.endswith("model.safetensors") and shape == (V, D) and dt == "F32"
    assert TargetConfig.from_json(target_dir).rope_scaling is None


# -- tokenizer ------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
RENDERED = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
            "<|im_start|>assistant\n")


@pytest.mark.parametrize("vocab", [96, 320])
def test_tokenizer_round_trip_and_chat_template(tmp_path, vocab):
    path = testing.write_tiny_target(tmp_path, **{**SIZES, "vocab": vocab})
    tok = Tokenizer.from_pretrained(path)
    assert tok.vocab_size == vocab
    text = "Hello world! def add(a, b):\n    return a + b  # 42"
    if vocab >= 272:
        text += " naïve café ✓"  # byte-level: anything round-trips
    ids = tok.encode(text)
    assert all(0 <= i < vocab for i in ids) and tok.decode(ids) == text
    assert tok.apply_chat_template(MESSAGES) == RENDERED
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == RENDERED[:-len("<|im_start|>assistant\n")]
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.decode(ids) == RENDERED
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),)
    with pytest.raises(ChatTemplateError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_template_file_and_added_token_dicts(tmp_path):
    path = testing.write_tiny_target(tmp_path, **SIZES)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(tc.pop("chat_template") + "{{ eos_token }}")
    tc["eos_token"] = {"content": "<|endoftext|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tc_id := Tokenizer(path).token_to_id("<|im_end|>"), 0]}))
    tok = Tokenizer(path)
    assert tok.apply_chat_template(MESSAGES) == RENDERED + "<|endoftext|>"
    eos = tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_id == eos and tok.eos_token_ids == (eos, tc_id)


def test_tokenizer_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        Tokenizer(str(tmp_path))
