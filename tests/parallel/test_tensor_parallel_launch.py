"""Tensor parallelism: starting (from_pretrained, serve, torchrun), stopping (shutdown, `with`,
at exit) and failures (a killed or failing worker is an error naming it, never a hang); the NCCL
tests need 2 GPUs."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.models.qwen3 import Qwen3Model
from dspark_rt.parallel import WorkerError
from dspark_rt.parallel.launch import _free_port
from tests.support.tp_support import (GREEDY, PROMPTS, _stop_groups, group, kw, pair,  # noqa: F401
                              parallel, script_env, single, stop_all)


def test_from_pretrained_and_shutdown(pair):
    """The public door: from_pretrained(tensor_parallel_size=2) as a context manager; the
    workers exit when it closes, and the Decoder refuses work afterwards."""
    stop_all()
    ref = single(pair, "dspark", "fixed").generate(PROMPTS[:2], GREEDY, use_tqdm=False)
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
    g = group("vanilla", *pair)
    dec = Decoder(g.target, g.drafter, None, tensor_parallel=g, mode="dspark")
    with pytest.raises(RuntimeError, match="outside a ParallelRunner call"):
        RoundWorkload(dec.runner, 2, 8)
    with pytest.raises(ValueError, match="needs sps="):
        Decoder(g.target, g.drafter, None, tensor_parallel=g, mode="dspark", policy="sync")
    assert dec.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids  # the group goes on


def test_one_group_per_process(pair):
    group("vanilla", *pair)
    with pytest.raises(RuntimeError, match="one tensor-parallel Decoder per process"):
        Decoder.from_pretrained(*pair, dtype="float64", tensor_parallel_size=2)


def test_serve_state_with_tensor_parallel_size(pair):
    """`dspark-rt serve --tensor-parallel-size 2` builds its Engine on a 2-rank Decoder."""
    from dspark_rt.tools.serve import build_state, parser
    assert parser().parse_args(["--target", str(pair[0]), "--tensor-parallel-size", "2"]
                               ).tensor_parallel_size == 2
    stop_all()
    state = build_state(*pair, mode="dspark", dtype="float64", max_num_seqs=2,
                        tensor_parallel_size=2)
    eng = state.engine
    try:
        rid = eng.add_request(PROMPTS[1], GREEDY)
        got = []
        while eng.has_unfinished():
            got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
        ref = single(pair, "dspark", "fixed").generate([PROMPTS[1]], GREEDY, use_tqdm=False)
        assert got == ref[0].token_ids
    finally:
        eng.runner.tensor_parallel.shutdown()


def test_a_killed_worker_is_an_error_not_a_hang(pair):
    dec = parallel("vanilla", pair, "dspark", "fixed")
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
    g = group("doomed", *pair)
    dec = Decoder(g.target, g.drafter, None, tensor_parallel=g, mode="dflash")
    g.group.send(("no such command", 0))
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) exited with code 1"):
        dec.generate(PROMPTS[:2], GREEDY, use_tqdm=False)


def test_ctrl_c_in_a_call_shuts_the_group_down(pair):
    """Ctrl-C inside a call the ranks run together (here: KeyboardInterrupt from the leader's
    third all-reduce) leaves the worker inside a collective. The interrupt reaches the caller,
    and the next call is a clear error within seconds, not a hang."""
    g = group("interrupted", *pair)
    dec = Decoder(g.target, g.drafter, None, tensor_parallel=g, mode="dspark")
    real, calls = g.group.all_reduce, []

    def interrupt(x):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(x)

    g.group.all_reduce = interrupt
    with pytest.raises(KeyboardInterrupt):
        dec.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    g.group.all_reduce = real
    errors = []

    def next_call():
        try:
            dec.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    t = threading.Thread(target=next_call, daemon=True)
    t.start()
    t.join(timeout=30)
    if t.is_alive():  # unblock the hung call's collective before failing
        for p in g.procs:
            p.kill()
        pytest.fail("the call after a KeyboardInterrupt hung for 30 s")
    assert len(errors) == 1 and isinstance(errors[0], WorkerError), errors
    assert "KeyboardInterrupt" in str(errors[0]) and "shut down" in str(errors[0])
    assert all(p.poll() is not None for p in g.procs)


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
    from tests.support.helpers import full_forward_logits
    _two_gpus()
    stop_all()
    opts = dict(dtype="float32", device="cuda", **kw(mode, policy))
    drafter = None if mode == "ar" else pair[1]
    ref = Decoder.from_pretrained(pair[0], drafter, **opts).generate(PROMPTS, GREEDY, use_tqdm=False)
    with Decoder.from_pretrained(pair[0], drafter, tensor_parallel_size=2, **opts) as dec:
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
    stop_all()
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
    stop_all()
    script = tmp_path / "tp_script.py"
    script.write_text(
        "import json, sys\nfrom dspark_rt import Decoder, SamplingParams\n"
        f"dec = Decoder.from_pretrained({str(pair[0])!r}, {str(pair[1])!r}, dtype='float64', "
        "mode='dspark', tensor_parallel_size=2)\n"
        "p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)\n"
        f"out = [o.token_ids for o in dec.generate({PROMPTS[:2]!r}, p, use_tqdm=False)]\n"
        "dec.shutdown()\nprint('TOKENS', json.dumps(out))\n")
    env = script_env()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), str(script)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("TOKENS"))
    ref = single(pair, "dspark", "fixed").generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert json.loads(line[len("TOKENS"):]) == [o.token_ids for o in ref]


def test_workers_stop_at_exit(pair, tmp_path):
    """A script that never calls shutdown(): its workers stop when it exits, and it exits 0."""
    script = tmp_path / "tp_exit.py"
    script.write_text(
        "from dspark_rt import Decoder, SamplingParams\n"
        f"dec = Decoder.from_pretrained({str(pair[0])!r}, {str(pair[1])!r}, dtype='float64', "
        "tensor_parallel_size=2)\n"
        "dec.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "print('PID', dec.tensor_parallel.procs[0].pid, flush=True)\n")
    env = script_env()
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    pid = int(next(l for l in r.stdout.splitlines() if l.startswith("PID")).split()[1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
