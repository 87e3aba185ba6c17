"""Tensor parallelism on the CPU: 2 ranks over gloo against the single-process runtime.

Models run in float64. The sharded forwards sum the row-parallel products in another order than
one process does (each rank's half, then the all-reduce), so logits differ by ~1e-16 relative;
in float64 an argmax can only flip on a near-tie of that size, and none of these prompts has one
(the tests assert exact token identity, never a tolerance). Starting, stopping and failures:
test_tensor_parallel_launch.py.
"""
import pytest
import torch

from dspark_rt import Decoder, SamplingParams, testing
from dspark_rt.engine import EngineConfig
from dspark_rt.models.qwen3 import Qwen3Model
from dspark_rt.parallel import shard as shard_mod
from dspark_rt.parallel.shard import Shard
from tests.support.tp_support import (GREEDY, PROMPTS, _stop_groups, group, pair, parallel,  # noqa: F401
                              single, stop_all)

CASES = [("ar", "fixed"), ("dflash", "fixed"), ("dspark", "fixed"), ("dspark", "threshold"),
         ("dspark", "sync"), ("dspark", "async"), ("dspark", "auto")]


@pytest.fixture(scope="module")
def odd_pair(tmp_path_factory):
    """Llama, tied LM head, V = 97 (not a multiple of 2: padded vocabulary shards), one KV head
    (replicated on both ranks), sharded safetensors files; a gated-head drafter."""
    t = tmp_path_factory.mktemp("tp_target")
    testing.write_tiny_target(t, arch="llama", vocab=97, hidden=64, layers=3, heads=4, kv_heads=1,
                              tie=True, sharded=True, seed=3)
    d = tmp_path_factory.mktemp("tp_drafter")
    testing.write_tiny_drafter(d, t, head="gated", markov_rank=8, confidence=True,
                               confidence_markov=True, layers=1, block_size=4,
                               target_layer_ids=[0, 1], seed=5)
    return t, d


@pytest.mark.parametrize("mode,policy", CASES)
def test_greedy_equals_single_process(pair, mode, policy):
    ref = [o.token_ids for o in single(pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)]
    outs = parallel("vanilla", pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    if mode != "ar":
        assert sum(o.metrics.num_rounds for o in outs) > 0


@pytest.mark.parametrize("mode,policy", [("dspark", "fixed"), ("dspark", "threshold"),
                                         ("dspark", "async")])
def test_seeded_sampling_equals_single_process(pair, mode, policy):
    """Philox keys travel in the SeqBatch: a seeded request draws the same tokens on 2 ranks;
    the acceptance test and metrics agree too (top-p filtering included)."""
    params = [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=16, ignore_eos=True,
                             top_p=0.9 if i % 2 else 1.0) for i in range(len(PROMPTS))]
    ref = single(pair, mode, policy).generate(PROMPTS, params, use_tqdm=False)
    got = parallel("vanilla", pair, mode, policy).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.metrics.as_dict() for o in got] == [o.metrics.as_dict() for o in ref]


def _engine_trace(dec):
    """Requests arrive over the steps, one is aborted mid-run, the pool is small (chunked
    prefill, queueing): every step's outputs."""
    eng = dec.new_engine(EngineConfig(num_pages=24, max_num_seqs=3, max_num_batched_tokens=24,
                                      chunk_size=8))
    arrivals = {0: PROMPTS[:2], 2: PROMPTS[2:4], 5: [list(range(40, 60))], 7: [PROMPTS[4]]}
    ids, trace, step = [], [], 0
    while step in arrivals or step < 8 or eng.has_unfinished():
        for i, p in enumerate(arrivals.get(step, [])):
            params = (SamplingParams(temperature=0.8, seed=len(ids), max_tokens=14, ignore_eos=True)
                      if len(ids) % 2 else GREEDY)
            ids.append(eng.add_request(p, params))
        if step == 4:
            eng.abort(ids[1])
        trace.append([(o.request_id - ids[0], o.new_token_ids, o.finished) for o in eng.step()])
        step += 1
    return trace


def test_engine_with_arrivals_and_aborts(pair):
    ref = _engine_trace(single(pair, "dspark", "threshold"))
    got = _engine_trace(parallel("vanilla", pair, "dspark", "threshold"))
    assert got == ref
    assert sum(len(s) for s in ref) > 10


def test_weights_per_rank(pair, tiny_target):
    """Each rank holds its slices: the sharded tensors halved, norms, fc and heads whole."""
    g = group("vanilla", *pair)
    full = Decoder.from_pretrained(*pair, dtype="float64")
    whole = sum(t.numel() * 8 for m in (full.target, full.drafter)
                for t in list(m.parameters()) + [b for b in m.buffers() if b is not None])
    stats = g.stats()
    assert len(stats) == 2 and stats[0]["weights"] == stats[1]["weights"]
    assert 0.45 * whole < stats[0]["weights"] < 0.62 * whole, (stats[0]["weights"], whole)


def test_ranks_read_only_their_slices(tiny_target, monkeypatch):
    """No rank reads a sharded tensor whole: get_tensor only for the replicated ones, and the
    slices put together give the checkpoint's tensors."""
    whole = {}
    from dspark_rt.checkpoint import tensors as tensors_mod
    real_open = tensors_mod.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *e):
            return self.f.__exit__(*e)

        def get_tensor(self, name):
            whole[name] = True
            return self.f.get_tensor(name)

        def get_slice(self, name):
            return self.f.get_slice(name)

        def __getattr__(self, attr):  # headers (keys, metadata) as the real file has them
            return getattr(self.f, attr)

    from dspark_rt.checkpoint import Checkpoint, target_specs
    from dspark_rt.checkpoint import TargetConfig
    cfg = TargetConfig.from_json(tiny_target)
    ckpt = Checkpoint(tiny_target)
    names = list(target_specs(cfg)[0])
    monkeypatch.setattr(tensors_mod, "safe_open", Spy)  # the one tensor reader (headers read above)
    parts = [Shard(cfg, r, 2).load(ckpt, names, torch.float64, "cpu") for r in range(2)]
    assert whole and all(n.endswith("norm.weight") for n in whole), sorted(whole)
    ref = Qwen3Model.from_pretrained(tiny_target, dtype="float64")
    sd = {("model." + k if k != "lm_head_weight" else "lm_head.weight"): v
          for k, v in ref.state_dict().items()}
    for n in names:
        dim = {None: None}.get(Shard(cfg, 0, 2).slice_of(n), (Shard(cfg, 0, 2).slice_of(n) or [None])[0])
        got = parts[0][n] if dim is None else torch.cat([parts[0][n], parts[1][n]], dim)
        assert torch.equal(got, sd[n]), n


def test_kv_head_replication_slices():
    """4 ranks over 2 KV heads: ranks 0, 1 read KV head 0, ranks 2, 3 KV head 1, each with the
    query heads that read it; 8 ranks over 4 query heads do not split."""
    from dspark_rt.checkpoint import TargetConfig
    cfg = TargetConfig("t", "qwen3", 64, 1, 4, 2, 16, 128, 97, 1e-6, 1e4, None, False, 64)
    rows = [(s.q_rows, s.kv_rows, s.vocab) for s in (Shard(cfg, r, 4) for r in range(4))]
    assert rows == [((0, 16), (0, 16), (0, 25)), ((16, 32), (0, 16), (25, 50)),
                    ((32, 48), (16, 32), (50, 75)), ((48, 64), (16, 32), (75, 97))]
    with pytest.raises(ValueError, match="tensor_parallel_size=8"):
        Shard(cfg, 0, 8)


@pytest.mark.parametrize("mode,policy", [("ar", "fixed"), ("dflash", "fixed"), ("dspark", "sync")])
def test_replicated_kv_tied_padded_vocab(odd_pair, mode, policy):
    ref = [o.token_ids for o in single(odd_pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)]
    outs = parallel("odd", odd_pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("kind,mode", [("rnn", "dspark"), ("zlab", "dflash")])
def test_other_drafters(tiny_target, tiny_drafters, kind, mode):
    """The RNN head (replicated) and a z-lab DFlash drafter (1+N block layout) on 2 ranks."""
    drafters = (tiny_target, tiny_drafters(kind, 4))
    ref = [o.token_ids for o in single(drafters, mode, "fixed").generate(PROMPTS, GREEDY, use_tqdm=False)]
    outs = parallel(kind, drafters, mode, "fixed").generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref


def test_dflash2_drafter(tiny_target, tmp_path_factory):
    """A DFlash2 drafter (convolutions and candidate selector whole on every rank, backbone
    sharded) on 2 ranks: the same tokens and the same acceptance, round by round, as on one
    process, greedy and seeded sampling. The drafter is test_dflash2's oracle (a bigram table of
    the target's greedy text in its selector), so drafts are accepted and their acceptance
    tells a mis-sharded drafter apart."""
    from tests.support.dflash2_oracle import oracle_dflash2
    plain = Decoder.from_pretrained(tiny_target, mode="ar", dtype="float64")
    seqs = [p + o.token_ids for p, o in zip(PROMPTS, plain.generate(PROMPTS, GREEDY, use_tqdm=False))]
    ddir = oracle_dflash2(tmp_path_factory.mktemp("tp_dflash2"), seqs, tiny_target, rank=32,
                          top_k=96, block_size=4, target_layer_ids=(0, 1))
    pair = (tiny_target, ddir)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
    for params in (GREEDY, sampled):
        ref = single(pair, "dspark", "fixed").generate(PROMPTS, params, use_tqdm=False)
        outs = parallel("dflash2", pair, "dspark", "fixed").generate(PROMPTS, params, use_tqdm=False)
        assert [(o.token_ids, o.metrics.num_rounds) for o in outs] == \
            [(o.token_ids, o.metrics.num_rounds) for o in ref]
        if params is GREEDY:
            assert sum(o.metrics.num_accepted_tokens for o in ref) > 20


@pytest.mark.parametrize("policy", ["sync", "auto"])
def test_workers_get_the_decision_never_the_policy(pair, policy):
    """A round command carries the SeqBatch and the policy's Decision; the policy object and the
    round state stay with the leader (its lengths reach the workers as one broadcast)."""
    import pickle

    from dspark_rt.policies import Decision, VerifyPolicy
    from dspark_rt.runner.state import RoundState
    dec = parallel("vanilla", pair, "dspark", policy)
    sent, send = [], dec.tensor_parallel.group.send
    dec.tensor_parallel.group.send = lambda cmd: sent.append(cmd) or send(cmd)
    try:
        outs = dec.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    finally:
        dec.tensor_parallel.group.send = send
    rounds = [c for c in sent if c[0] == "round"]
    assert rounds and all(o.token_ids for o in outs)
    for cmd in rounds:
        assert any(isinstance(a, Decision) for a in cmd)
        assert not any(isinstance(a, (VerifyPolicy, RoundState)) for a in cmd), cmd
        assert b"AutoPolicy" not in pickle.dumps(cmd) and b"SyncScheduler" not in pickle.dumps(cmd)
