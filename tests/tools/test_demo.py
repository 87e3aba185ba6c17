"""`dspark-rt demo`: every figure for every mode and head in its JSON, greedy equality with plain
decoding, the repetition-loop detector, the speed verdict and the path without matplotlib."""
import json
import os
import sys

import pytest

from dspark_rt.__main__ import main as cli
from dspark_rt.tools import demo

SHIPPED = demo._shipped() is not None
needs_pair = pytest.mark.skipif(not SHIPPED, reason="no shipped pair in dspark_rt/pretrained")
FIGURES = ("tokens", "tokens_per_s", "tokens_per_s_runs", "speed_ratio", "mean_acceptance_length",
           "draft_acceptance_rate", "acceptance_by_position", "acceptance_histogram", "loop_share",
           "samples")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One quick run on two prompts (the other tests reuse it)."""
    out = tmp_path_factory.mktemp("demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "PROMPTS", demo.PROMPTS[:2])
        return demo.main(out, quick=True, as_json=True), out


@needs_pair
def test_json_keeps_every_figure_for_every_mode_and_head(quick):
    res, out = quick
    assert json.loads((out / "results.json").read_text())["modes"].keys() == res["modes"].keys()
    heads = [h for h in demo.HEADS if (demo.PRETRAINED / h / "config.json").is_file()]
    assert list(res["modes"]) == ["ar", "dflash"] + heads and "dspark" in heads
    assert res["pair"] == "shipped" and res["threads"] == 1
    assert res["machine"]["cpu"] and res["machine"]["cores"] >= 1
    assert set(res["load"]) == {"before", "after", "cores", "limit"}
    assert isinstance(res["speed_meaningful"], bool)
    assert (res["speed_note"] is None) == res["speed_meaningful"]
    assert res["temperature"] == demo.TEMPERATURE and res["seed"] == demo.SEED
    for name, r in res["modes"].items():
        for kind in ("greedy", "sampled"):
            f = r[kind]
            assert all(k in f for k in FIGURES), (name, kind)
            assert len(f["tokens_per_s_runs"]) == res["repetitions"] and f["tokens_per_s"] > 0
            assert len(f["samples"]) == 2
            assert all(s["text"] and len(s["token_ids"]) == res["max_tokens"] and "loop" in s
                       for s in f["samples"])
            if name == "ar":
                assert f["speed_ratio"] == 1.0 and f["mean_acceptance_length"] == 1.0
            else:  # the trained drafters accept drafts, greedy and sampled
                assert len(f["acceptance_by_position"]) == 7
                assert f["mean_acceptance_length"] > 1.0, (name, kind)
        assert (r["calibration"] is not None) == (r["mode"] == "dspark"), name
    if demo._has_matplotlib():
        assert (out / "acceptance_by_position.png").is_file()
        assert (out / "reliability_dspark.png").is_file()


@needs_pair
def test_greedy_texts_equal_across_modes(quick):
    res, _ = quick
    ref = [s["token_ids"] for s in res["modes"]["ar"]["greedy"]["samples"]]
    for name, r in res["modes"].items():
        assert r["equals_ar"], name
        assert [s["token_ids"] for s in r["greedy"]["samples"]] == ref, name
        assert [s["text"] for s in r["greedy"]["samples"]] == \
            [s["text"] for s in res["modes"]["ar"]["greedy"]["samples"]]


@pytest.mark.parametrize("ids,text,kind", [
    ([5] * 30, "", "tokens"),                                  # one token over and over
    (list(range(40)) + [1, 2, 3, 4, 5, 6, 7, 8] * 3, "", "tokens"),  # period 8, span 24
    (list(range(100, 140)) + [7, 8] * 12, "", "tokens"),        # falls into it late, within 64
    (list(range(64)), "x = 1\nfoo(x)\n  foo(x)\nfoo(x)\n", "lines"),  # the same line 3 times
    (list(range(64)), "a = 1\nb = 2\n\na = 1\nb = 2\na = 1\nb = 2", "lines"),  # a 2-line block
])
def test_repetition_loop_finds_loops(ids, text, kind):
    assert demo.repetition_loop(ids, text)["kind"] == kind


@pytest.mark.parametrize("ids,text", [
    (list(range(64)), "def f(x):\n    return x\n\n\ndef g(y):\n    return y\n"),
    (list(range(42)) + [7, 8] * 11, ""),            # a period-2 run of 22 tokens: too short
    (list(range(30)) + list(range(9)) * 3, ""),     # period 9: longer than max_period
    ([], ""), ([3], "x"),
])
def test_repetition_loop_leaves_other_text_alone(ids, text):
    assert demo.repetition_loop(ids, text) is None


def test_repetition_loop_looks_within_the_first_64_tokens():
    assert demo.repetition_loop([1, 2, 3, 4] * 16) == {"kind": "tokens", "period": 4, "span": 64}
    assert demo.repetition_loop(list(range(64)) + [1, 2, 3, 4] * 10) is None


def test_speed_verdict():
    assert demo.speed_verdict(0.2, 1.0, 2, {"ar greedy": 1.1}) == (True, None)
    ok, why = demo.speed_verdict(0.2, 1.6, 2, {"ar greedy": 1.1})  # 1.6 > 0.75 x 2
    assert not ok and "load average 1.60" in why
    ok, why = demo.speed_verdict(0.2, 0.2, 2, {"ar greedy": 1.1, "dspark sampled": 1.6})
    assert not ok and "dspark sampled" in why and "load" not in why


@needs_pair
def test_high_load_marks_the_speed_not_meaningful(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(demo, "PROMPTS", demo.PROMPTS[:1])
    res = demo.main(tmp_path, quick=True)
    printed = capsys.readouterr().out
    assert "SPEED RATIOS UNRELIABLE" in printed and "load average 9.00" in printed
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["speed_meaningful"] is False and "load average 9.00" in saved["speed_note"]
    assert saved["load"]["before"] == saved["load"]["after"] == 9.0
    assert res["speed_meaningful"] is False


def test_without_the_shipped_pair_the_demo_stops_naming_the_folder(tmp_path, monkeypatch, capsys):
    """No random stand-in (its acceptance would mean nothing): one line naming what is missing."""
    monkeypatch.setattr(demo, "PRETRAINED", tmp_path / "gone")
    with pytest.raises(SystemExit) as e:
        cli(["demo", "--quick", "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(tmp_path / "gone") in err and "make_tiny_pair.sh" in err


@needs_pair
def test_without_matplotlib_the_demo_skips_the_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    monkeypatch.setattr(demo, "PROMPTS", demo.PROMPTS[:1])
    assert cli(["demo", "--quick", "--out", str(tmp_path / "d")]) == 0
    assert "plots skipped: matplotlib is not installed (pip install matplotlib)" in \
        capsys.readouterr().out
    saved = json.loads((tmp_path / "d" / "results.json").read_text())
    assert saved["plots"] == {} and saved["modes"]["ar"]["greedy"]["samples"]
    assert not list((tmp_path / "d").glob("*.png"))


@pytest.mark.parametrize("equal", [True, False])
def test_demo_cli_fails_when_a_mode_differs_from_plain_decoding(monkeypatch, tmp_path, equal):
    """`dspark-rt demo` exits 1 naming the mode whose greedy output is not plain decoding's."""
    modes = {"ar": {"equals_ar": True}, "dspark": {"equals_ar": equal}}
    monkeypatch.setattr(demo, "main", lambda *a, **k: {"modes": modes})
    assert cli(["demo", "--out", str(tmp_path)]) == (0 if equal else 1)
