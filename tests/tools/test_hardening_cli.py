"""Bad command lines, files and chat templates end with one clear line (exit 2), never a
traceback or a hang; the tokenizer's errors name the file or the template."""
import json
import re
import shutil
import time

import pytest

from dspark_rt.__main__ import main
from dspark_rt.checkpoint.config import CheckpointError
from dspark_rt.checkpoint.tokenizer import ChatTemplateError, Tokenizer


def _fails_cleanly(argv, capsys, match):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    assert re.search(match, err), err


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(3):
        (d / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    return d


@pytest.fixture
def blocked(tmp_path):
    """A path no folder can be created at (its parent is a file)."""
    f = tmp_path / "a_file"
    f.write_text("x")
    return f / "out"


# -- 9. train and demo ---------------------------------------------------------------------

def test_train_stages_fail_cleanly(tmp_path, corpus, blocked, tiny_target, capsys):
    missing = tmp_path / "missing"
    out = tmp_path / "o"
    cases = [
        (["tokenizer", "--out", str(blocked), "--corpus", str(corpus), "--vocab", "300"], "a_file"),
        (["tokenizer", "--out", str(out), "--corpus", str(missing)], "missing|no \\*.py"),
        (["target", "--tokenizer", str(missing), "--out", str(out), "--corpus", str(corpus)], "missing"),
        (["regen", "--target", str(missing), "--out", str(out / "r.pt"), "--corpus", str(corpus)], "missing"),
        (["drafter", "--target", str(missing), "--out", str(out), "--corpus", str(corpus)], "missing"),
        (["drafter", "--target", str(tiny_target), "--out", str(out), "--target-layer-ids", "a,b"],
         "target-layer-ids"),
        (["drafter", "--target", str(tiny_target), "--out", str(out), "--corpus", str(corpus),
          "--target-layer-ids", "0,99"], "99|layer"),
        (["drafter", "--target", str(tiny_target), "--out", str(out), "--gamma", "0"], "gamma"),
        (["prompts", "--out", str(out / "p.jsonl"), "--corpus", str(missing)], "missing|no \\*.py"),
        (["prompts", "--out", str(blocked), "--corpus", str(corpus), "--num", "2", "--chars", "100"], "a_file|Not a directory"),
    ]
    for argv, match in cases:
        _fails_cleanly(["train"] + argv, capsys, match)


@pytest.mark.parametrize("argv,match", [
    (["--device", "gpu"], "device"),
    (["--device", "cuda:0"], "CUDA|cuda"),
])
def test_demo_bad_device(argv, match, capsys):
    if "cuda" in argv[-1]:
        import torch
        if torch.cuda.is_available():
            pytest.skip("needs a machine without CUDA")
    _fails_cleanly(["demo", "--quick"] + argv, capsys, match)


def test_demo_unwritable_out(blocked, capsys):
    _fails_cleanly(["demo", "--quick", "--out", str(blocked)], capsys, "a_file|Not a directory")


# -- 9. profile and eval ---------------------------------------------------------------------

def test_profile_infinite_seconds_is_refused(tiny_target, tiny_drafters, capsys):
    _fails_cleanly(["profile", "--target", str(tiny_target), "--drafter",
                    str(tiny_drafters("vanilla", 4)), "--seconds", "inf"], capsys, "seconds")


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"turns": ["def f(x):"]}) + "\n")
    return p


def test_eval_bad_sps_names_the_file(tiny_target, tiny_drafters, prompts_file, tmp_path, capsys):
    bad = tmp_path / "bad_sps.json"
    bad.write_text(json.dumps({"format": "dspark_rt.sps", "tabel": []}))
    _fails_cleanly(["eval", "--target", str(tiny_target), "--drafter", str(tiny_drafters("vanilla", 4)),
                    "--prompts", str(prompts_file), "--policy", "sync", "--sps", str(bad),
                    "--out", str(tmp_path / "e")], capsys, "bad_sps.json")


def test_eval_confidence_policy_with_headless_drafter(tiny_target, tiny_drafters, prompts_file,
                                                      tmp_path, capsys):
    _fails_cleanly(["eval", "--target", str(tiny_target), "--drafter", str(tiny_drafters("zlab", 4)),
                    "--prompts", str(prompts_file), "--policy", "sync", "--out", str(tmp_path / "e")],
                   capsys, "confidence head")


def _copy_target(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def test_eval_truncated_tokenizer_names_the_file(tiny_target, tiny_drafters, prompts_file,
                                                 tmp_path, capsys):
    t = _copy_target(tiny_target, tmp_path / "t")
    tj = t / "tokenizer.json"
    tj.write_text(tj.read_text()[:500])
    _fails_cleanly(["eval", "--target", str(t), "--drafter", str(tiny_drafters("vanilla", 4)),
                    "--prompts", str(prompts_file), "--out", str(tmp_path / "e")],
                   capsys, "tokenizer.json")


def test_eval_chat_template_that_raises_outside_jinja(tiny_target, tiny_drafters, prompts_file,
                                                      tmp_path, capsys):
    t = _copy_target(tiny_target, tmp_path / "t")
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ 1 / 0 }}"
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    _fails_cleanly(["eval", "--target", str(t), "--drafter", str(tiny_drafters("vanilla", 4)),
                    "--prompts", str(prompts_file), "--chat", "--out", str(tmp_path / "e")],
                   capsys, "chat template.*ZeroDivisionError")


# -- 10. the tokenizer's errors -----------------------------------------------------------------

def test_corrupt_tokenizer_json_names_the_file(tiny_target, tmp_path):
    t = _copy_target(tiny_target, tmp_path / "t")
    (t / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    with pytest.raises(CheckpointError, match=re.escape(str(t / "tokenizer.json"))):
        Tokenizer(str(t))


def _with_template(tiny_target, tmp_path, template):
    t = _copy_target(tiny_target, tmp_path / "t")
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer(str(t)), str(t / "tokenizer_config.json")


@pytest.mark.parametrize("template,messages,match", [
    ("{{ 1 / 0 }}", [{"role": "user", "content": "x"}], "ZeroDivisionError"),
    ("{% for m in messages %}{{ m['content'] + '!' }}{% endfor %}",
     [{"role": "user", "content": 5}], "TypeError"),
    ("{{ raise_exception('no system role') }}", [{"role": "user", "content": "x"}], "no system role"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     [{"role": "user", "content": "x"}], "range"),
    ("{{ 'x' * 1000000000 }}", [{"role": "user", "content": "x"}], "too large"),
    ("{% for m in messages", [{"role": "user", "content": "x"}], "."),
])
def test_chat_template_errors_name_the_template(tiny_target, tmp_path, template, messages, match):
    tok, where = _with_template(tiny_target, tmp_path, template)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template(messages)
    assert time.monotonic() - t0 < 30  # bounded: nested huge loops end early
    assert where in str(e.value) and re.search(match, str(e.value))
