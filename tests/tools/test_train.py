"""dspark_rt.train: the dense training forwards equal the runtime's, a few training steps lower the
loss and write checkpoints that Decoder.from_pretrained serves losslessly, resume continues the
step counter, and the shipped pair decodes exactly like plain greedy decoding."""
import json
from pathlib import Path

import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.models.batch import AttnMeta
from dspark_rt.models.drafter import Drafter
from dspark_rt.models.qwen3 import Qwen3Model, Rotary
from dspark_rt.ops import reference
from dspark_rt.train.__main__ import main as train_main
from dspark_rt.train.dense import drafter_block_forward, target_forward
from dspark_rt.train.drafter_net import DrafterNet, drafter_config, save_drafter
from tests.support.helpers import full_forward_logits

PRETRAINED = Path(__file__).resolve().parents[2] / "dspark_rt" / "pretrained"
TINY = ["--hidden", "32", "--layers", "3", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--intermediate", "64", "--ctx", "128", "--seq", "32"]
FAST = ["--threads", "1", "--batch", "4", "--lr", "1e-2", "--warmup", "2"]


def _corpus(root: Path):
    """A few KB of Python-like text in a handful of files."""
    root.mkdir()
    for f in range(6):
        body = "".join(f"def func_{f}_{i}(x, y={i}):\n    total = x + y * {i}\n"
                       f"    for k in range({i + 2}):\n        total += k\n    return total\n\n"
                       for i in range(8))
        (root / f"mod_{f}.py").write_text(f'"""Module {f}."""\nimport os\n\n' + body)


def _run(argv) -> dict:
    """Runs `dspark-rt train ...` in-process and returns the JSON summary it prints."""
    import contextlib
    import io
    buf, threads = io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(buf):
            assert train_main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide; leave other tests alone
    out = buf.getvalue()
    return json.loads(out[out.index("{"):])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    corpus = tmp / "corpus"
    _corpus(corpus)
    c = ["--corpus", str(corpus)]
    _run(["tokenizer", "--out", str(tmp / "tok"), "--vocab", "300", *c])
    s_target = _run(["target", "--tokenizer", str(tmp / "tok"), "--out", str(tmp / "target"),
                     "--steps", "40", "--save-every", "20", *TINY, *FAST, *c])
    _run(["regen", "--target", str(tmp / "target"), "--out", str(tmp / "regen.pt"), "--num", "8",
          "--prompt-len", "16", "--new-tokens", "24", "--batch", "8", *c])
    common = ["--target", str(tmp / "target"), "--gamma", "4", "--rank", "8", "--anchors", "4",
              "--steps", "30", "--save-every", "30", *FAST, *c]
    s_dspark = _run(["drafter", "--out", str(tmp / "dspark"), "--head", "gated",
                     "--data", str(tmp / "regen.pt"), *common])
    s_rnn = _run(["drafter", "--out", str(tmp / "rnn"), "--head", "rnn",
                  "--data", str(tmp / "regen.pt"), *common])
    s_dflash = _run(["drafter", "--out", str(tmp / "dflash"), "--head", "none", *common])
    s_up = _run(["drafter", "--out", str(tmp / "upgraded"), "--head", "vanilla", "--upgrade-dflash",
                 str(tmp / "dflash"), *common, "--steps", "10"])
    return tmp, {"target": s_target, "dspark": s_dspark, "rnn": s_rnn, "dflash": s_dflash,
                 "upgraded": s_up}


def test_training_lowers_the_loss(trained):
    _, s = trained
    for name in ("target", "dspark", "rnn", "dflash"):
        assert s[name]["final_loss"] < s[name]["first_loss"], (name, s[name])


def test_upgrade_dflash_keeps_the_backbone(trained):
    tmp, s = trained
    assert s["upgraded"]["trainable"] < s["upgraded"]["params"]
    from safetensors.torch import load_file
    base = load_file(tmp / "dflash" / "model.safetensors")
    up = load_file(tmp / "upgraded" / "model.safetensors")
    for name, t in base.items():
        assert torch.equal(t, up[name]), name
    assert any(n.startswith("markov_head") for n in up)
    assert any(n.startswith("confidence_head") for n in up)


@pytest.mark.parametrize("drafter,mode", [("dspark", "dspark"), ("dspark", "dflash"),
                                          ("rnn", "dspark"), ("dflash", "dflash"),
                                          ("upgraded", "dspark")])
def test_trained_checkpoints_decode_like_ar(trained, drafter, mode):
    tmp, _ = trained
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def func_1_3(x, y=3):\n", "import os\n\n\ndef"]
    ar = Decoder.from_pretrained(str(tmp / "target"), mode="ar", dtype="float64")
    ref = [o.token_ids for o in ar.generate(prompts, params, use_tqdm=False)]
    dec = Decoder.from_pretrained(str(tmp / "target"), str(tmp / drafter), mode=mode,
                                  dtype="float64")
    outs = dec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.num_rounds for o in outs) > 0


def test_resume_continues_the_step_counter(trained, tmp_path):
    tmp, _ = trained
    args = ["target", "--tokenizer", str(tmp / "tok"), "--out", str(tmp_path / "t"),
            "--corpus", str(tmp / "corpus"), "--save-every", "2", *TINY, *FAST]
    first = _run(args + ["--steps", "4"])
    again = _run(args + ["--steps", "6", "--resume"])
    assert (first["start_step"], again["start_step"]) == (0, 4)
    state = torch.load(tmp_path / "t" / "train_state.pt", weights_only=False)
    assert state["step"] == 6 and state["optim"]["state"]
    Qwen3Model.from_pretrained(str(tmp_path / "t"))  # the export after resuming loads


def test_dense_target_equals_runtime(trained):
    tmp, _ = trained
    tgt = Qwen3Model.from_pretrained(str(tmp / "target"), dtype="float64")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tgt.config.vocab_size, (2, 20), generator=g)
    logits, _, _ = target_forward(tgt, ids)
    for b in range(2):
        # float64 both ways: only summation order differs
        torch.testing.assert_close(logits[b], full_forward_logits(tgt, ids[b].tolist()),
                                   rtol=1e-10, atol=1e-12)


def _heads_against_runtime(net, dr, U, h, anchor):
    """The runtime samples greedily (ops.reference.markov_sample); feeding its own tokens back as
    x_{k-1} to the training heads must reproduce its corrected logits z and confidence logits."""
    z = U.clone()
    w = {k: getattr(dr, k) for k in ("w1", "w2", "gate_w", "gate_b", "joint_w", "joint_b",
                                     "conf_w", "conf_b")}
    R = h.shape[0]
    tokens, _, _, conf = reference.markov_sample(
        z, h, anchor, dr.head, **w, temperature=torch.zeros(R),
        seed=torch.zeros(R, dtype=torch.int64), stream=torch.zeros(R, dtype=torch.int64),
        round_=torch.zeros(R, dtype=torch.int64))
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], 1)
    z_train, conf_train = net.heads(U, h, prev)
    torch.testing.assert_close(z_train, z, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(conf_train, conf, rtol=1e-10, atol=1e-12)
    return tokens


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", "none"])
def test_dense_drafter_equals_runtime(trained, tmp_path, head):
    """drafter_block_forward (SDPA over [context ; all blocks] with a mask) against the runtime's
    context_update + forward_block over a paged cache, block by block; then the heads against
    ops.reference.markov_sample fed the same previous tokens."""
    tmp, _ = trained
    tcfg = json.loads((tmp / "target" / "config.json").read_text())
    gamma, ids = 5, [-1, 1]
    cfg = drafter_config(tcfg, layers=2, gamma=gamma, target_layer_ids=ids, mask_token_id=3,
                         head=head, rank=8, confidence=True)
    torch.manual_seed(0)
    net = DrafterNet(cfg)
    for p in net.parameters():  # away from the zero-initialised heads, so every term matters
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.2)
    save_drafter(net, tmp_path, "float64")
    net = net.double()
    tgt = Qwen3Model.from_pretrained(str(tmp / "target"), dtype="float64")
    dr = Drafter.from_pretrained(str(tmp_path), tgt)
    B, L, V = 2, 24, tgt.config.vocab_size
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, V, (B, L), generator=g)
    anchors = torch.tensor([[1, 6, 17], [2, 3, 12]])  # overlapping blocks, first and last anchors
    _, feats, _ = target_forward(tgt, seqs, capture=ids, logits=False)
    block = torch.full((B, 3, gamma), 3)
    block[:, :, 0] = torch.gather(seqs, 1, anchors)
    h = drafter_block_forward(net, Rotary(tgt.config, torch.float64, "cpu"), tgt.embed_tokens,
                              feats, block, anchors)
    for b in range(B):
        for a in range(3):
            p = int(anchors[b, a])
            cache = dr.make_cache(p + gamma, 1)
            dr.context_update(feats[b, :p], torch.arange(p), torch.arange(p), cache)
            meta = AttnMeta(torch.tensor([0, gamma], dtype=torch.int32),
                            torch.tensor([p + gamma], dtype=torch.int32),
                            torch.arange(p + gamma, dtype=torch.int32)[None],
                            torch.arange(p, p + gamma), causal=False)
            ref = dr.forward_block(block[b, a], torch.arange(p, p + gamma), meta, cache)
            torch.testing.assert_close(h[b, a], ref, rtol=1e-10, atol=1e-12)
    hr = h.reshape(-1, gamma, h.shape[-1])
    _heads_against_runtime(net, dr, tgt.lm_head(hr), hr, block[:, :, 0].reshape(-1))


def test_trained_rnn_drafter_equals_runtime(trained):
    """The briefly trained rnn drafter's file loads as a DSpark drafter with the rnn head, and the
    training forward of the saved weights (teacher-forced along the block) equals the runtime's
    markov_sample on the same hidden states and tokens."""
    tmp, _ = trained
    from safetensors.torch import load_file
    dec = Decoder.from_pretrained(str(tmp / "target"), str(tmp / "rnn"), mode="dspark",
                                  dtype="float64")
    tgt, dr = dec.target, dec.drafter
    cfg = json.loads((tmp / "rnn" / "config.json").read_text())
    assert cfg["markov_head_type"] == "rnn" and cfg["confidence_head_with_markov"]
    net = DrafterNet(cfg)
    net.load_state_dict({n: t.double() for n, t in load_file(tmp / "rnn" / "model.safetensors")
                         .items()})
    net = net.double()
    assert dr.head == "rnn" and dr.joint_w.shape == (3 * cfg["markov_rank"],
                                                      2 * cfg["markov_rank"] + tgt.config.hidden_size)
    gamma, V = cfg["block_size"], tgt.config.vocab_size
    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(0, V, (2, 20), generator=g)
    anchors = torch.tensor([[1, 9], [4, 13]])
    _, feats, _ = target_forward(tgt, seqs, capture=cfg["target_layer_ids"], logits=False)
    block = torch.full((2, 2, gamma), cfg["mask_token_id"])
    block[:, :, 0] = torch.gather(seqs, 1, anchors)
    h = drafter_block_forward(net, Rotary(tgt.config, torch.float64, "cpu"), tgt.embed_tokens,
                              feats, block, anchors).reshape(-1, gamma, tgt.config.hidden_size)
    _heads_against_runtime(net, dr, tgt.lm_head(h), h, block[:, :, 0].reshape(-1))
    # the trained head is not a no-op: it moves the logits
    assert net.markov_head.markov_w2.weight.abs().max() > 0


def test_heldout_loss_scores_every_held_out_token_once(trained):
    """`train heldout` against the runtime's own forward, window by window: every token of the
    held-out file after its first is scored exactly once, against the right next token."""
    import math
    from dspark_rt.train.corpus import EOT, load_corpus
    from dspark_rt.train.tokenizer_train import load_tokenizer
    tmp, _ = trained
    seq = 16
    s = _run(["heldout", "--target", str(tmp / "target"), "--corpus", str(tmp / "corpus"),
              "--seq", str(seq), "--threads", "1"])
    held = load_corpus(str(tmp / "corpus"), max_bytes=1).heldout
    tok = load_tokenizer(str(tmp / "target"))
    tgt = Qwen3Model.from_pretrained(str(tmp / "target"), dtype="float64")
    nats, n = 0.0, 0
    for text in held:
        ids = tok.encode(text).ids + [tok.token_to_id(EOT)]
        for i in range(1, len(ids)):
            start = (i - 1) // seq * seq  # the window holding the prediction of ids[i]
            logp = full_forward_logits(tgt, ids[start:i]).log_softmax(-1)[-1]
            nats -= logp[ids[i]].item()
            n += 1
    assert (s["files"], s["tokens"]) == (len(held), n) and n > seq
    assert s["nats_per_token"] == pytest.approx(nats / n, rel=1e-5)
    n_bytes = sum(len(t.encode()) for t in held)
    assert s["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


@pytest.mark.skipif(not (PRETRAINED / "target" / "config.json").is_file(),
                    reason="no shipped pair in dspark_rt/pretrained")
def test_shipped_pair_decodes_like_ar():
    prompts = ["def add(a, b):\n    return", "import os\n\n\nclass Cache:\n    def __init__(self"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tgt = str(PRETRAINED / "target")
    ref = [o.token_ids for o in Decoder.from_pretrained(tgt, mode="ar", dtype="float64")
           .generate(prompts, params, use_tqdm=False)]
    for drafter, mode in (("dspark", "dspark"), ("dspark_gated", "dspark"),
                          ("dspark_rnn", "dspark"), ("dflash", "dflash")):
        dec = Decoder.from_pretrained(tgt, str(PRETRAINED / drafter), mode=mode, dtype="float64")
        outs = dec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == ref, drafter
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0, drafter
    size = sum(f.stat().st_size for f in PRETRAINED.rglob("*") if f.is_file())
    assert size <= 20 * 2 ** 20, size


def _naive_unlikelihood(logits, inputs, targets):
    """-sum over the distinct earlier tokens c != target of log(1 - p(c)), position by position."""
    p = torch.softmax(logits.double(), -1)
    total, n = 0.0, 0
    for b in range(inputs.shape[0]):
        for t in range(inputs.shape[1]):
            cands = set(inputs[b, : t + 1].tolist()) - {int(targets[b, t])}
            total += sum(-torch.log((1 - p[b, t, c]).clamp_min(1e-5)) for c in cands)
            n += 1
    return total / n


def test_unlikelihood_term_equals_its_definition():
    """Candidates are the distinct tokens read so far (the current input included), minus the
    target: checked against a position-by-position loop on random inputs with repeats."""
    from dspark_rt.train.unlikelihood import context_candidates, unlikelihood_loss
    g = torch.Generator().manual_seed(0)
    for B, L, V in ((2, 9, 5), (3, 17, 11), (1, 1, 4)):
        ids = torch.randint(0, V, (B, L + 1), generator=g)
        logits = torch.randn(B, L, V, generator=g) * 3
        got = float(unlikelihood_loss(logits, ids[:, :-1], ids[:, 1:]))
        want = float(_naive_unlikelihood(logits, ids[:, :-1], ids[:, 1:]))
        assert abs(got - want) <= 1e-5 * abs(want), (B, L, V, got, want)
        cand = context_candidates(ids[:, :-1], ids[:, 1:], V)
        assert not cand.gather(2, ids[:, 1:, None]).any()  # never the target
        assert cand.gather(2, ids[:, :-1, None]).sum() == (ids[:, :-1] != ids[:, 1:]).sum()


def test_training_on_with_unlikelihood_lowers_repeat_probability(trained, tmp_path):
    """`--init` continues a target's weights; the unlikelihood term lowers the probability the
    model gives to tokens its context already holds, against the same steps without it."""
    from dspark_rt.train.unlikelihood import context_candidates
    tmp, _ = trained
    base = ["target", "--tokenizer", str(tmp / "tok"), "--init", str(tmp / "target"),
            "--corpus", str(tmp / "corpus"), "--steps", "20", "--save-every", "20", "--seq", "32",
            "--threads", "1", "--batch", "4", "--lr", "3e-3", "--warmup", "2"]
    plain = _run(base + ["--out", str(tmp_path / "plain")])
    ul = _run(base + ["--out", str(tmp_path / "ul"), "--unlikelihood", "3.0"])
    assert plain["init"] == str(tmp / "target") and ul["unlikelihood"] == 3.0
    seq = _run(base + ["--steps", "2", "--batch", "2", "--out", str(tmp_path / "seq"),
                       "--seq-unlikelihood", "1.0"])  # later options win
    assert seq["seq_unlikelihood"] == 1.0 and {"ce", "seq_ul", "repeats"} <= set(seq["last"])
    Qwen3Model.from_pretrained(str(tmp_path / "seq"))  # its export loads
    from dspark_rt.train.tokenizer_train import load_tokenizer
    text = (tmp / "corpus" / "mod_0.py").read_text()
    ids = torch.tensor([load_tokenizer(str(tmp / "tok")).encode(text).ids[:64]])
    mass = {}  # the probability mass each model puts on tokens its context already holds
    for name in ("plain", "ul"):
        model = Qwen3Model.from_pretrained(str(tmp_path / name), dtype="float32")
        model.rotary = Rotary(model.config, torch.float32, "cpu")
        with torch.no_grad():
            logits, _, _ = target_forward(model, ids[:, :-1])
        cand = context_candidates(ids[:, :-1], ids[:, 1:], logits.shape[-1])
        mass[name] = float((torch.softmax(logits, -1) * cand).sum(-1).mean())
    assert mass["ul"] < 0.85 * mass["plain"], mass


def test_sequence_unlikelihood_marks_repeated_ngrams_of_the_continuation():
    """repeat_mask marks, from the continuation's start on, every token of a 4-gram that already
    occurred earlier in the row (prefix included); the loss is -log(1 - p) of exactly those
    tokens at the positions predicting them; greedy_continue appends argmax tokens."""
    from dspark_rt.train.unlikelihood import greedy_continue, repeat_mask, sequence_unlikelihood_loss
    ids = torch.tensor([[1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8],
                        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
                        [1, 2, 3, 1, 2, 3, 1, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10]])
    m = repeat_mask(ids, start=6)
    # row 0: the 4-gram 1 2 3 4 repeats at 5..8 (marked from 6, the continuation's start), and
    # 5 6 7 8 at 13..16; row 1 never repeats; row 2: 1 2 3 1 repeats at 3..6, ending at the start
    assert m[0].nonzero()[:, 0].tolist() == [6, 7, 8, 13, 14, 15, 16] and not m[1].any()
    assert m[2].nonzero()[:, 0].tolist() == [6]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, 20, generator=g)
    p = torch.softmax(logits, -1)
    marked = [(0, t) for t in (6, 7, 8, 13, 14, 15, 16)] + [(2, 6)]
    want = -sum(torch.log(1 - p[b, t - 1, ids[b, t]]) for b, t in marked) / len(marked)
    assert torch.allclose(sequence_unlikelihood_loss(logits, ids, m), want, rtol=1e-5)
    table = torch.randn(20, 20, generator=g)  # a "model" whose next token depends on the last
    fwd = lambda x: table[x]
    out = greedy_continue(fwd, ids[:2, :3], 5)
    for t in range(3, 8):
        assert torch.equal(out[:, t], table[out[:, t - 1]].argmax(-1))
