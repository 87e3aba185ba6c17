"""bench/gpu_lease.sh, the one command a lent GPU runs, in its CPU mode: a typo in the script,
its Python, the kernel driver or the benchmarks' arguments shows here and not on the device."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_lease.sh"


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
    for name in ("steps.tsv", "preflight.json", "kernels.json", "e2e.json", "summary.txt"):
        assert f"gpu_lease/{name}" in names, names
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status["preflight"] == "ok" and status["build"] == "skipped (--skip)"
    for step in ("tests_ops", "kernels", "e2e"):
        assert status[step] == "ok", (step, status)
    assert summary["tests"]["tests_ops"]["collected"] > 0
    ops = {k["op"] for k in summary["kernels"] if "error" not in k}
    assert ops == {"markov_sample", "rejection_sample", "prefix_topk", "verify_attention"}
    assert summary["seed"] == os.environ.get("DSPARK_TEST_SEED", "1701")
    assert (tmp_path / "summary.json").exists()


def test_paper_model_runs_and_no_change_models_slower(tmp_path):
    """bench/paper_model.py (the estimates the first lease is read against) runs, and under its
    own assumptions no row of this session's schedule is slower than before."""
    out = tmp_path / "model.json"
    subprocess.run([sys.executable, str(SCRIPT.parent / "paper_model.py"), "--json", str(out)], check=True,
                   capture_output=True)
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == {"markov_sample", "verify_attention"}
    for r in rows:
        assert r["floor_us"] <= r["after_us"] <= r["before_us"] + 1e-9, r
