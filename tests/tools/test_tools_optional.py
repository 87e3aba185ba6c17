"""The CLI tools without their optional parts: eval and calibrate without matplotlib (the `plot`
extra) write their results and skip the plots with a note."""
import json
import sys

import pytest

from dspark_rt.__main__ import main


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("def f(x):", "import os")))
    return p


@pytest.fixture
def no_matplotlib(monkeypatch):
    """`import matplotlib` (and any submodule) raises ImportError."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_eval_without_matplotlib_writes_its_results(tiny_target, tiny_drafters, prompts_file,
                                                    tmp_path, capsys, no_matplotlib):
    out = tmp_path / "eval"
    assert main(["eval", "--target", str(tiny_target), "--drafter", str(tiny_drafters("vanilla", 4)),
                 "--prompts", str(prompts_file), "--max-tokens", "8", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tau"] >= 1 and summary["n_prompts"] == 2 and summary["plots"] == {}
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not list(out.glob("*.png"))


def test_calibrate_without_matplotlib_writes_its_json(tiny_target, tiny_drafters, prompts_file,
                                                      tmp_path, capsys, no_matplotlib):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--target", str(tiny_target), "--drafter",
                 str(tiny_drafters("vanilla", 4)), "--prompts", str(prompts_file),
                 "--max-tokens", "16", "--method", "sts", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["temperatures"]
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))
