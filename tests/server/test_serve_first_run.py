"""A first run that keeps its word: `--target shipped` / `--drafter shipped` name the package's
own pretrained folders (package data, so they exist after a pip install); the Makefile compiles
CUDA only where a GPU answers or DSPARK_CUDA=1 asks, and shows pip's progress; the demo's
acceptance plot says what it plots."""
import os
import shutil
import subprocess
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest

from dspark_rt.outputs import SpecMetrics
from dspark_rt.tools import serve

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_resolves_to_the_package_folders():
    a = serve.parser().parse_args(["--target", "shipped", "--drafter", "shipped"])
    pretrained = files("dspark_rt") / "pretrained"
    assert a.target == str(pretrained / "target") and a.drafter == str(pretrained / "dspark")
    assert (Path(a.target) / "tokenizer.json").is_file()


def test_package_data_holds_the_shipped_pair():
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data["package-data"]["dspark_rt"]
    for folder in ("target", "dspark"):
        for f in (files("dspark_rt") / "pretrained" / folder).iterdir():
            if f.name != "README.md":
                rel = Path("pretrained") / folder / f.name
                assert any(rel.match(g) for g in globs), f"{rel} is not package data"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"fastapi", "uvicorn", "prometheus-client"} <= set(extras["serve"]) <= set(extras["test"])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_builds_cuda_only_when_asked():
    def dry(**env):
        e = {k: v for k, v in os.environ.items() if k != "DSPARK_CUDA"} | env
        return subprocess.run(["make", "-n", "build", "VENV=/nonexistent-venv"], cwd=ROOT, env=e,
                              capture_output=True, text=True, check=True).stdout
    gpu = subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0
    assert f"DSPARK_CUDA={int(gpu)}" in dry()
    ci = dry(DSPARK_CUDA="1")  # CI asks for the sm_80 + sm_90a build explicitly
    assert "DSPARK_CUDA=1" in ci and " -q" not in ci


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_demo_installs_no_test_clients():
    """A first `make demo` installs the runtime and the plots, not the tests' clients (lm-eval,
    the openai client, xgrammar, ...): those come with `make test`."""
    def dry(goal):
        return subprocess.run(["make", "-n", goal, "VENV=/nonexistent-venv"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    demo, test = dry("demo"), dry("test")
    for client in ("lm-eval", "openai", "xgrammar", "pytest"):
        assert client not in demo and client in test, client


def test_demo_acceptance_plot_is_labelled_as_computed(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from dspark_rt.tools import demo
    m = SpecMetrics(3)
    for verified, accepted in [(3, 0), (3, 1), (3, 3), (2, 2), (3, 1)]:
        m.record(verified, accepted)
    figure = {}
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figure.setdefault("f", self))
    row = dict(mean_acceptance_length=m.mean_acceptance_length,
               acceptance_by_position=m.acceptance_by_position)
    demo._plot_acceptance({"dspark": {"mode": "dspark", "greedy": row, "sampled": row}},
                          tmp_path / "a.png")
    ax = figure["f"].axes[0]
    # what is plotted: rounds that accepted drafts 1..k over rounds that verified k
    want = [sum(a > k for v, a in [(3, 0), (3, 1), (3, 3), (2, 2), (3, 1)] if v > k) /
            sum(v > k for v, _ in [(3, 0), (3, 1), (3, 3), (2, 2), (3, 1)]) for k in range(3)]
    assert np.allclose([p.get_height() for p in ax.patches], want)
    assert ax.get_ylabel() == "P(drafts 1..k all accepted | k verified)"
