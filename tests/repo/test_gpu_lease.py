"""bench/gpu_lease.sh, the one command a lent GPU runs, in its CPU mode: a typo in the script,
its Python, the kernel driver or the benchmarks' arguments shows here and not on the device."""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from dspark_rt import ops

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_lease.sh"
STEPS = ["build", "tests_first", "sanitizer_tickets", "tests_ops", "tests_graphs", "kernels", "e2e", "sanitizer"]


def _bench(name):
    sys.path.insert(0, str(SCRIPT.parent))  # bench_kernels imports the bench_<op>.py beside it
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_cpu_mode_writes_the_archive(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    # Left out: the build, which would rebuild the extension the other tests import (it is the
    # same `setup.py build_ext --inplace`, with DSPARK_CUDA=0 on the CPU), and the collection of
    # the graph tests (the same pytest command as tests_ops): < 60 s on two busy cores.
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--skip", "build,tests_graphs"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "gpu_lease summary: mode cpu" in res.stdout
    with tarfile.open(tmp_path / "gpu_lease.tar.gz") as tar:
        names = tar.getnames()
        summary = json.load(tar.extractfile("gpu_lease/summary.json"))
        preflight = json.load(tar.extractfile("gpu_lease/preflight.json"))
    for name in ("steps.tsv", "preflight.json", "kernels.json", "e2e.json", "summary.txt"):
        assert f"gpu_lease/{name}" in names, names
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status["preflight"] == "ok" and status["build"] == "skipped (--skip)"
    for step in ("tests_first", "sanitizer_tickets_cpu", "tests_ops", "kernels", "e2e", "sanitizer_cpu"):
        assert status[step] == "ok", (step, status)
    # the newest CUDA paths' tests first, none of them again in tests_ops; the ticket cases first
    assert list(status)[2:5] == ["tests_first", "sanitizer_tickets_cpu", "tests_ops"], list(status)
    first, rest = (summary["tests"][k]["collected"] for k in ("tests_first", "tests_ops"))
    assert first > 0 and rest > 0
    with tarfile.open(tmp_path / "gpu_lease.tar.gz") as tar:
        logs = {k: tar.extractfile(f"gpu_lease/{k}.log").read().decode() for k in ("tests_first", "tests_ops")}
    for name in ("test_verify_attention_fused_merge", "test_verify_attention_merge_tickets_reset",
                 "test_cupy_arrays_in_and_out", "test_ops_outputs.py::test_rejection_sample_writes_every_output"):
        assert name in logs["tests_first"] and name not in logs["tests_ops"], name
    assert "test_verify_attention_plan_reuse" in logs["tests_ops"] and "test_sanitizer" not in logs["tests_ops"]
    # verify_attention first; the eager reference timed at each op's first (smallest) shape only
    assert [k["op"] for k in summary["kernels"]][0] == "verify_attention"
    by_op = {}
    for k in summary["kernels"]:
        by_op.setdefault(k["op"], []).append(k)
    assert set(by_op) == {"markov_sample", "rejection_sample", "prefix_topk", "verify_attention"}
    for op, rows in by_op.items():
        assert rows[0]["ratio_vs_ref"] and all(r["ratio_vs_ref"] is None for r in rows[1:]), (op, rows)
    assert summary["seed"] == os.environ.get("DSPARK_TEST_SEED", "1701")
    assert (tmp_path / "summary.json").exists()
    first = (tmp_path / "summary.txt").read_text().splitlines()[0]
    assert first.startswith("KERNELS DID NOT RUN: cpu mode"), first
    assert summary["rerun"] == "" and "rerun: nothing failed" in res.stdout
    # the pre-flight looks for the programs setup.py runs, not for python modules of that name
    assert preflight["cmake"] and os.path.isabs(preflight["cmake"]), preflight


def test_failed_build_stops_the_run_and_the_first_line_says_so(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, DSPARK_LEASE_FAIL_BUILD="1")
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--budget", "300"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert lines[0] == "KERNELS DID NOT RUN: build failed(1)", lines[:3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status == {"preflight": "ok", "build": "failed(1)",
                      **{s: "skipped (build failed)" for s in STEPS[1:]}}, status
    with tarfile.open(tmp_path / "gpu_lease.tar.gz") as tar:
        ran = {Path(n).stem for n in tar.getnames()}
    assert not ran & {"tests_first", "sanitizer_tickets_cpu", "tests_ops", "kernels", "e2e", "sanitizer_cpu"}, ran
    # the rerun builds again (nothing is skipped) and keeps the run's own options
    assert summary["rerun"] == "bash bench/gpu_lease.sh --dry-run --budget 300", summary["rerun"]


def test_rerun_skips_what_passed_and_the_build(tmp_path):
    """The printed rerun command on a run where the build passed and a later step failed."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    # e2e fails (its ops refuse a backend that does not exist, ~15 s); the sanitizer driver
    # calls _C itself and passes
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--skip", "build,tests_first,tests_ops,tests_graphs,kernels"],
                         cwd=tmp_path, env=dict(env, DSPARK_BACKEND="nope"),
                         capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status["e2e"] == "failed(1)" and status["sanitizer_cpu"] == status["sanitizer_tickets_cpu"] == "ok", status
    assert res.returncode == 1
    assert summary["rerun"] == ("bash bench/gpu_lease.sh --skip build,tests_first,tests_ops,tests_graphs,kernels,"
                                "sanitizer --dry-run")


def test_junit_check_counts_all_skipped_as_nothing_ran(tmp_path):
    """pytest exits 0 when every case skips (the CUDA tests without a CUDA _C): lease_junit.py
    is what makes the lease call that a failure."""
    (tmp_path / "test_x.py").write_text("import pytest\n"
                                        "@pytest.mark.skipif(True, reason='no CUDA _C')\n"
                                        "def test_a(): pass\n"
                                        "def test_b(): pass\n")
    check = lambda xml: subprocess.run([sys.executable, str(SCRIPT.parent / "lease_junit.py"), str(xml)],
                                       capture_output=True).returncode
    for k, want in (("test_a", 1), ("test_b", 0), ("nothing_matches", 1)):
        xml = tmp_path / f"{k}.xml"
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_x.py"),
                              "-k", k, f"--junitxml={xml}"], capture_output=True, text=True, cwd=tmp_path)
        assert res.returncode in (0, 5), res.stdout  # all skipped: 0; none selected: 5
        assert check(xml) == want, (k, xml.read_text())
    assert check(tmp_path / "missing.xml") == 1


@pytest.mark.parametrize("bench", ["bench_kernels", "bench_e2e"])
def test_benchmarks_refuse_a_gpu_without_cuda_kernels(bench, monkeypatch):
    """On a machine with a CUDA device, a build without CUDA kernels would have every op fall
    back to the reference: both benchmarks exit non-zero before measuring."""
    if "cuda" in ops.available_backends():
        pytest.skip("this build has CUDA kernels")
    mod = _bench(bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--device", "cpu", "--quick", "--ops", "prefix_topk"] if bench == "bench_kernels" else \
        ["--device", "cpu", "--batch", "1", "--max-tokens", "1", "--modes", "ar/fixed"]
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert "no CUDA kernels" in str(e.value.code), e.value.code


def test_bench_kernels_exits_nonzero_when_an_op_fails(tmp_path, monkeypatch):
    """An op that raises is recorded with its error, the next op still runs, and the exit
    status is 1 (it was 0: the lease read such a run as ok)."""
    import runpy
    import types

    def broken(args):
        raise RuntimeError("planted")

    ran = []
    monkeypatch.setitem(sys.modules, "bench_prefix_topk", types.SimpleNamespace(run=broken))
    monkeypatch.setitem(sys.modules, "bench_markov_sample", types.SimpleNamespace(run=lambda a: ran.append(a) or {}))
    path = tmp_path / "k.json"
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--device", "cpu", "--quick", "--json", str(path),
                                      "--ops", "prefix_topk", "markov_sample"])
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SCRIPT.parent / "bench_kernels.py"), run_name="__main__")
    assert e.value.code == 1
    assert "planted" in json.loads(path.read_text())["ops"]["prefix_topk"]["error"] and ran


def test_sanitizer_driver_runs_every_op_without_torch():
    """bench/sanitize_ops.py is what compute-sanitizer runs on the lease: here on the C++
    kernels, in a process that must not import torch (the reason it exists), with the dtype
    and head codes of the ops door."""
    drv = _bench("sanitize_ops")
    assert drv.HEADS == ops.HEADS and drv.DTYPE_CODE == {str(k)[6:]: v for k, v in ops.door.DTYPE_CODE.items()}
    code = ("import runpy, sys; sys.argv = ['sanitize_ops.py', '--device', 'cpu']; "
            f"runpy.run_path({str(SCRIPT.parent / 'sanitize_ops.py')!r}, run_name='__main__'); "
            "assert 'torch' not in sys.modules, 'the driver imported torch'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "sanitize-ok" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    # the atomic-ticket paths (split-KV merge, residual merge) come first, before any other op
    assert res.stdout.index("  attention n_q=") < res.stdout.index("  rejection V=") < res.stdout.index("markov")


def test_paper_model_runs_and_no_change_models_slower(tmp_path):
    """bench/paper_model.py (the estimates the first lease is read against) runs, and under its
    own assumptions no row of this session's schedule is slower than before."""
    out = tmp_path / "model.json"
    subprocess.run([sys.executable, str(SCRIPT.parent / "paper_model.py"), "--json", str(out)], check=True,
                   capture_output=True)
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == {"markov_sample", "rejection_sample", "verify_attention"}
    for r in rows:
        assert r["floor_us"] <= r["after_us"] <= r["before_us"] + 1e-9, r
