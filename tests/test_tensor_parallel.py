"""Tensor parallelism on the CPU: 2 ranks over gloo against the single-process runtime.

Models run in float64. The sharded forwards sum the row-parallel products in another order than
one process does (each rank's half, then the all-reduce), so logits differ by ~1e-16 relative;
in float64 an argmax can only flip on a near-tie of that size, and none of these prompts has one
(the tests assert exact token identity, never a tolerance). Launching a group costs seconds here
(fresh interpreters importing torch), so one group serves the module; a process holds one group
at a time (the default process group), so `_group` stops the previous one first.
"""
import json
import time
from pathlib import Path

import pytest
import torch

from dspark_rt import Decoder, SamplingParams, testing
from dspark_rt.engine import EngineConfig
from dspark_rt.models.qwen3 import Qwen3Model
from dspark_rt.parallel import TensorParallel, WorkerError
from dspark_rt.parallel import shard as shard_mod
from dspark_rt.parallel.shard import Shard
from dspark_rt.policies.sps import SPSProfile

PROMPTS = [[5], [3, 17, 42, 8, 9, 11, 2], [60, 61], list(range(10, 31)), [7, 7, 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SPS = SPSProfile.from_pairs({B: 1000.0 / (1.0 + B / 4.0) for B in range(1, 129)})
CASES = [("ar", "fixed"), ("dflash", "fixed"), ("dspark", "fixed"), ("dspark", "threshold"),
         ("dspark", "sync"), ("dspark", "async"), ("dspark", "auto")]

_live = {}


def _group(key, target, drafter):
    """The one live group of this process, for (target, drafter)."""
    if key not in _live:
        for other in list(_live):
            _live.pop(other).shutdown()
        _live[key] = TensorParallel(2, target, drafter, torch.float64, "cpu")
    return _live[key]


@pytest.fixture(scope="module", autouse=True)
def _stop_groups():
    yield
    for g in list(_live.values()):
        g.shutdown()
    _live.clear()


@pytest.fixture(scope="module")
def pair(tiny_target, tiny_drafters):
    return tiny_target, tiny_drafters("vanilla", 4)


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


def _kw(mode, policy):
    kw = dict(mode=mode, policy=policy, threshold=0.3)
    if policy in ("sync", "async"):
        kw["sps"] = SPS
    if policy == "auto":
        kw["sps"] = (SPS, SPS)
    return kw


def _single(pair, mode, policy):
    return Decoder.from_pretrained(pair[0], None if mode == "ar" else pair[1], dtype="float64",
                                   **_kw(mode, policy))


def _parallel(key, pair, mode, policy):
    """A Decoder over the live group of `pair` (a fresh runner on both ranks)."""
    g = _group(key, *pair)
    return Decoder(g.target, g.drafter, None, tensor_parallel=g, **_kw(mode, policy))


@pytest.mark.parametrize("mode,policy", CASES)
def test_greedy_equals_single_process(pair, mode, policy):
    ref = [o.token_ids for o in _single(pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)]
    outs = _parallel("vanilla", pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)
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
    ref = _single(pair, mode, policy).generate(PROMPTS, params, use_tqdm=False)
    got = _parallel("vanilla", pair, mode, policy).generate(PROMPTS, params, use_tqdm=False)
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
    ref = _engine_trace(_single(pair, "dspark", "threshold"))
    got = _engine_trace(_parallel("vanilla", pair, "dspark", "threshold"))
    assert got == ref
    assert sum(len(s) for s in ref) > 10


def test_weights_per_rank(pair, tiny_target):
    """Each rank holds its slices: the sharded tensors halved, norms, fc and heads whole."""
    g = _group("vanilla", *pair)
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
    real_open = shard_mod.safe_open

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

    monkeypatch.setattr(shard_mod, "safe_open", Spy)
    from dspark_rt.checkpoint import Checkpoint, target_specs
    from dspark_rt.config import TargetConfig
    cfg = TargetConfig.from_json(tiny_target)
    ckpt = Checkpoint(tiny_target)
    names = list(target_specs(cfg)[0])
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
    from dspark_rt.config import TargetConfig
    cfg = TargetConfig("t", "qwen3", 64, 1, 4, 2, 16, 128, 97, 1e-6, 1e4, None, False, 64)
    rows = [(s.q_rows, s.kv_rows, s.vocab) for s in (Shard(cfg, r, 4) for r in range(4))]
    assert rows == [((0, 16), (0, 16), (0, 25)), ((16, 32), (0, 16), (25, 50)),
                    ((32, 48), (16, 32), (50, 75)), ((48, 64), (16, 32), (75, 97))]
    with pytest.raises(ValueError, match="tensor_parallel_size=8"):
        Shard(cfg, 0, 8)


@pytest.mark.parametrize("mode,policy", [("ar", "fixed"), ("dflash", "fixed"), ("dspark", "sync")])
def test_replicated_kv_tied_padded_vocab(odd_pair, mode, policy):
    ref = [o.token_ids for o in _single(odd_pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)]
    outs = _parallel("odd", odd_pair, mode, policy).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref


def test_from_pretrained_and_shutdown(pair):
    """The public door: from_pretrained(tensor_parallel_size=2) as a context manager; the
    workers exit when it closes, and the Decoder refuses work afterwards."""
    for g in list(_live):
        _live.pop(g).shutdown()
    ref = _single(pair, "dspark", "fixed").generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    with Decoder.from_pretrained(*pair, dtype="float64", mode="dspark",
                                 tensor_parallel_size=2) as dec:
        outs = dec.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        procs = list(dec.tensor_parallel.procs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(p.poll() == 0 for p in procs)
    with pytest.raises(WorkerError, match="shut down"):
        dec.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_a_plain_runner_over_sharded_models_refuses(pair):
    """What would wait forever for the other ranks (the profiler's own Runner over a
    tensor-parallel Decoder's models) raises instead."""
    from dspark_rt.runner.profiling import RoundWorkload
    g = _group("vanilla", *pair)
    dec = Decoder(g.target, g.drafter, None, tensor_parallel=g, mode="dspark")
    with pytest.raises(RuntimeError, match="outside a ParallelRunner call"):
        RoundWorkload(dec.runner, 2, 8)
    with pytest.raises(ValueError, match="needs sps="):
        Decoder(g.target, g.drafter, None, tensor_parallel=g, mode="dspark", policy="sync")
    assert dec.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids  # the group goes on


def test_serve_state_with_tensor_parallel_size(pair):
    """`dspark-rt serve --tensor-parallel-size 2` builds its Engine on a 2-rank Decoder."""
    from dspark_rt.tools.serve import build_state, parser
    assert parser().parse_args(["--target", str(pair[0]), "--tensor-parallel-size", "2"]
                               ).tensor_parallel_size == 2
    for g in list(_live):
        _live.pop(g).shutdown()
    state = build_state(*pair, mode="dspark", dtype="float64", max_num_seqs=2,
                        tensor_parallel_size=2)
    eng = state.engine
    try:
        rid = eng.add_request(PROMPTS[1], GREEDY)
        got = []
        while eng.has_unfinished():
            got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
        ref = _single(pair, "dspark", "fixed").generate([PROMPTS[1]], GREEDY, use_tqdm=False)
        assert got == ref[0].token_ids
    finally:
        eng.runner.tensor_parallel.shutdown()


def test_a_killed_worker_is_an_error_not_a_hang(pair):
    dec = _parallel("vanilla", pair, "dspark", "fixed")
    stream = dec.stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)
    worker = dec.tensor_parallel.procs[0]
    worker.kill()
    worker.wait()
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 30
    with pytest.raises(WorkerError):
        dec.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_a_failing_worker_is_an_error_naming_it(pair):
    """A worker that raises (here: a command it does not know) prints its traceback and exits;
    the leader's next call names it."""
    g = _group("doomed", *pair)
    dec = Decoder(g.target, g.drafter, None, tensor_parallel=g, mode="dflash")
    g.group.send(("no such command", 0))
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) exited with code 1"):
        dec.generate(PROMPTS[:2], GREEDY, use_tqdm=False)


def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (NCCL puts one rank on each)")


@pytest.mark.gpu
@pytest.mark.parametrize("mode,policy", [("ar", "fixed"), ("dflash", "fixed"), ("dspark", "fixed"),
                                         ("dspark", "async")])
def test_nccl_greedy_equals_single_gpu(pair, mode, policy):
    """2 ranks over NCCL (cuda:0, cuda:1) against one GPU, in float32 (the CUDA kernels take no
    float64): equal up to the first position whose top two float64 target logits lie within
    1e-3 (a near-tie float32 may order either way in the two reductions)."""
    from tests.helpers import full_forward_logits
    _two_gpus()
    for g in list(_live):
        _live.pop(g).shutdown()
    kw = dict(dtype="float32", device="cuda", **_kw(mode, policy))
    drafter = None if mode == "ar" else pair[1]
    ref = Decoder.from_pretrained(pair[0], drafter, **kw).generate(PROMPTS, GREEDY, use_tqdm=False)
    with Decoder.from_pretrained(pair[0], drafter, tensor_parallel_size=2, **kw) as dec:
        got = dec.generate(PROMPTS, GREEDY, use_tqdm=False)
    ref64 = Qwen3Model.from_pretrained(pair[0], dtype="float64")
    for prompt, a, b in zip(PROMPTS, ref, got):
        diff = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if diff is None:
            continue
        top2 = full_forward_logits(ref64, list(prompt) + a.token_ids[:diff])[-1].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-3, f"prompt {prompt}: differs at {diff} without a near-tie"


@pytest.mark.gpu
def test_nccl_killed_worker_is_an_error(pair):
    """Between calls the leader sees the dead worker before it sends; the error names it."""
    _two_gpus()
    for g in list(_live):
        _live.pop(g).shutdown()
    dec = Decoder.from_pretrained(*pair, dtype="float32", device="cuda", tensor_parallel_size=2)
    stream = dec.stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)
    dec.tensor_parallel.procs[0].kill()
    dec.tensor_parallel.procs[0].wait()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in stream:
            pass


def test_torchrun_launch(pair, tmp_path):
    """Ranks started by torchrun (the several-node recipe, here on one node): rank 0 gets the
    Decoder, rank 1 serves it inside from_pretrained and exits when it shuts down."""
    import os
    import subprocess
    import sys
    for g in list(_live):
        _live.pop(g).shutdown()
    script = tmp_path / "tp_script.py"
    script.write_text(
        "import json, sys\nfrom dspark_rt import Decoder, SamplingParams\n"
        f"dec = Decoder.from_pretrained({str(pair[0])!r}, {str(pair[1])!r}, dtype='float64', "
        "mode='dspark', tensor_parallel_size=2)\n"
        "p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)\n"
        f"out = [o.token_ids for o in dec.generate({PROMPTS[:2]!r}, p, use_tqdm=False)]\n"
        "dec.shutdown()\nprint('TOKENS', json.dumps(out))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    from dspark_rt.parallel.launch import _free_port
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), str(script)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("TOKENS"))
    ref = _single(pair, "dspark", "fixed").generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert json.loads(line[len("TOKENS"):]) == [o.token_ids for o in ref]


def test_workers_stop_at_exit(pair, tmp_path):
    """A script that never calls shutdown(): its workers stop when it exits, and it exits 0."""
    import os
    import subprocess
    import sys
    script = tmp_path / "tp_exit.py"
    script.write_text(
        "from dspark_rt import Decoder, SamplingParams\n"
        f"dec = Decoder.from_pretrained({str(pair[0])!r}, {str(pair[1])!r}, dtype='float64', "
        "tensor_parallel_size=2)\n"
        "dec.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "print('PID', dec.tensor_parallel.procs[0].pid, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    pid = int(next(l for l in r.stdout.splitlines() if l.startswith("PID")).split()[1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
