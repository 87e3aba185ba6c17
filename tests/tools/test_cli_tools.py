"""calibrate / profile / eval on the tiny checkpoints: files written, loaded back, CLI paths,
prompt-file errors, the profile cache."""
import json
import logging
import shutil

import pytest

from dspark_rt import Decoder
from dspark_rt.runner import profiling
from dspark_rt.__main__ import main
from dspark_rt.tools.calibrate import calibrate
from dspark_rt.tools.evaluate import evaluate
from dspark_rt.tools.prompts import PromptFileError, load_prompts, read_turns
from dspark_rt.policies.prefix import SyncScheduler
from dspark_rt.policies.sps import SPSProfile
from dspark_rt.policies.sts import STSResult
from dspark_rt.checkpoint.tokenizer import Tokenizer

GAMMA = 4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "Hello world! How are you today?", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
         "Speculative decoding drafts a block of tokens.", "A paged key value cache."]
PROFILE = dict(B_values=[1, 2, 4, 7, 10], seconds=0.1, context_len=16, max_batch=2)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [json.dumps({"turns": [t, "And a second turn."]}) for t in TEXTS]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")  # a blank line
    return path


@pytest.fixture(scope="module")
def drafter(tiny_drafters):
    return tiny_drafters("vanilla", GAMMA)


@pytest.fixture(scope="module")
def calibrated(tiny_target, drafter, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "cal.json"
    res = calibrate(tiny_target, drafter, prompts_file, out, max_tokens=24, progress=False)
    return out, res


# -- prompt files -----------------------------------------------------------------------------

def test_prompt_file_reading(tiny_target, prompts_file):
    assert read_turns(prompts_file) == [[t, "And a second turn."] for t in TEXTS]
    assert load_prompts(prompts_file, limit=2) == TEXTS[:2]
    tok = Tokenizer.from_pretrained(tiny_target)
    ids = load_prompts(prompts_file, tok, limit=1, max_prompt_tokens=5)
    assert ids == [tok.encode(TEXTS[0])[-5:]]
    chat = load_prompts(prompts_file, tok, chat=True, limit=1)[0]
    assert tok.decode(chat).count("<|im_start|>user") == 2  # both turns, as user messages
    with pytest.raises(ValueError, match="limit"):
        read_turns(prompts_file, limit=0)


@pytest.mark.parametrize("bad,why", [("{not json", "not valid JSON"), ('{"turns": []}', "turns"),
                                     ('["a"]', "turns"), ('{"turns": ["a", 3]}', "turns")])
def test_malformed_line_names_file_and_line(tmp_path, bad, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"turns": ["ok"]}\n\n' + bad + "\n")
    with pytest.raises(PromptFileError, match=rf"bad\.jsonl:3: .*{why}"):
        read_turns(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PromptFileError, match="empty"):
        read_turns(tmp_path / "empty.jsonl")


# -- calibrate --------------------------------------------------------------------------------

def test_calibrate_writes_loadable_json(tiny_target, drafter, calibrated):
    out, res = calibrated
    back = STSResult.load(out)
    assert len(back.temperatures) == GAMMA and all(t > 0 for t in back.temperatures)
    assert [r["position"] for r in back.report] == list(range(1, GAMMA + 1))
    assert all(k in back.report[0] for k in ("ece_before", "ece_after", "auc_before", "brier_after"))
    assert back.report[0]["n"] > 0 and back.metadata["n_prompts"] == len(TEXTS)
    # STS minimises position 1's ECE over a grid that holds t = 1
    assert back.report[0]["ece_after"] <= back.report[0]["ece_before"] + 1e-12
    assert (out.parent / "cal_reliability.png").stat().st_size > 0
    dec = Decoder.from_pretrained(tiny_target, drafter, calibration=out)
    assert dec.engine.calibration.temperatures == back.temperatures


# -- profile ----------------------------------------------------------------------------------

def test_profile_runner_table(tiny_target, drafter):
    dec = Decoder.from_pretrained(tiny_target, drafter)
    prof = profiling.profile_runner(dec.runner, progress=False, **PROFILE)
    assert prof.tokens == PROFILE["B_values"] and all(v > 0 for v in prof.rounds_per_s)
    assert prof.key["max_tokens"] == 2 * (GAMMA + 1) == prof.max_tokens
    assert prof.key["model"].startswith(f"{tiny_target.name}@") and prof.key["dtype"] == "float32"
    import torch
    from dspark_rt.policies import Decision
    lengths = SyncScheduler(prof).lengths(Decision((GAMMA, GAMMA)), None, torch.full((2, GAMMA), 0.9),
                                          torch.tensor([GAMMA, GAMMA]))
    assert lengths.shape == (2,) and int(lengths.sum()) + 2 <= prof.max_tokens
    with pytest.raises(ValueError, match="B_values"):
        profiling.profile_runner(dec.runner, B_values=[11], seconds=0.1, context_len=16, max_batch=2,
                                 progress=False)


def test_context_profile_writes_the_drafter_context_of_B_positions(tiny_target, drafter):
    """Shape "context" (what AutoPolicy prices exploring with) times the drafter context update
    of B positions: a step writes exactly the context the drafter computes from those
    features, at positions 0.. of as few pool requests as hold them (here 9 and 1)."""
    import torch
    dec = Decoder.from_pretrained(tiny_target, drafter)
    work = profiling.RoundWorkload(dec.runner, 2, 4, shape="context")
    r, B = work.runner, 2 * (GAMMA + 1)
    assert work.max_tokens == B and work.room == 4 + GAMMA + 1 == 9
    work.step(B)
    got = (r.dcache.k_all.clone(), r.dcache.v_all.clone())
    r.dcache.k_all.zero_()
    r.dcache.v_all.zero_()
    ps, spans = r.page_size, [(0, 0, 9), (1, 9, 1)]  # (request, first feature row, positions)
    slots = torch.tensor([work.batch.drafter_pages[q][p // ps] * ps + p % ps
                          for q, _, n in spans for p in range(n)])
    pos = torch.tensor([p for _, _, n in spans for p in range(n)])
    r.drafter.context_update(work.features[:B], pos, slots, r.dcache)
    for mine, want in zip(got, (r.dcache.k_all, r.dcache.v_all)):
        flat, ref = mine.flatten(1, 2), want.flatten(1, 2)  # [layers, slots, h_kv, head_dim]
        torch.testing.assert_close(flat[:, slots], ref[:, slots])
    key = profiling.runner_key(dec.runner, max_batch=2, context_len=4, shape="context")
    assert "/dspark-context/" in key["model"] and key["max_tokens"] == B
    ar = Decoder.from_pretrained(tiny_target, mode="ar")
    with pytest.raises(ValueError, match="needs a drafter"):
        profiling.RoundWorkload(ar.runner, 2, 4, shape="context")


def test_load_or_profile_reuses_cache(tiny_target, drafter, tmp_path, monkeypatch, caplog):
    dec = Decoder.from_pretrained(tiny_target, drafter)
    calls = []
    real = profiling.profile_runners
    monkeypatch.setattr(profiling, "profile_runners", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(B_values=PROFILE["B_values"], seconds=0.1, max_batch=2, progress=False)
    first = profiling.load_or_profile(dec.runner, tmp_path, context_len=16, **kw)
    second = profiling.load_or_profile(dec.runner, tmp_path, context_len=16, **kw)
    assert len(calls) == 1 and second == first
    profiling.load_or_profile(dec.runner, tmp_path, context_len=24, **kw)  # another key: measure
    assert len(calls) == 2 and len(list(tmp_path.glob("sps_*.json"))) == 2
    # a cached file whose key no longer matches (edited, or another dtype) is measured again
    path = profiling.cache_path(first.key, tmp_path)
    d = json.loads(path.read_text())
    d["key"]["dtype"] = "bfloat16"
    path.write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING):
        again = profiling.load_or_profile(dec.runner, tmp_path, context_len=16, **kw)
    assert len(calls) == 3 and again.key["dtype"] == "float32" and "dtype" in caplog.text
    assert SPSProfile.load(path).key["dtype"] == "float32"


# -- eval -------------------------------------------------------------------------------------

def test_evaluate_summary_and_plots(tiny_target, drafter, prompts_file, calibrated, tmp_path):
    s = evaluate(tiny_target, drafter, prompts_file, policy="threshold", threshold=0.3,
                 calibration=calibrated[0], out_dir=tmp_path, max_tokens=16, limit=4,
                 progress=False)
    back = json.loads((tmp_path / "summary.json").read_text())
    assert back["tau"] == pytest.approx(s["tau"]) and back["tau"] >= 1.0
    assert back["n_prompts"] == 4 and 4 <= back["tokens"] <= 4 * 16 and back["tokens_per_s"] > 0
    assert 0 <= back["mean_verify_length"] <= GAMMA
    assert len(back["acceptance_by_position"]) == GAMMA
    assert back["temperatures"] == STSResult.load(calibrated[0]).temperatures
    conf = back["confidence"]
    assert conf["pooled"]["n"] > 0 and 0 <= conf["pooled"]["ece"] <= 1
    for name in ("acceptance_by_position.png", "reliability.png"):
        assert (tmp_path / name).stat().st_size > 0


# -- command line -----------------------------------------------------------------------------

def test_cli_subcommands(tiny_target, drafter, prompts_file, tmp_path, capsys):
    common = ["--target", str(tiny_target), "--drafter", str(drafter)]
    d = tmp_path / "drafter"  # a copy: the default calibration path is inside the drafter
    shutil.copytree(drafter, d)
    assert main(["calibrate", "--target", str(tiny_target), "--drafter", str(d), "--prompts",
                 str(prompts_file), "--limit", "3", "--max-tokens", "12"]) == 0
    assert len(STSResult.load(d / "dspark_calibration.json").temperatures) == GAMMA
    sps = tmp_path / "sps.json"
    assert main(["profile", *common, "--out", str(sps), "--seconds", "0.1", "--max-batch", "2",
                 "--context-len", "16"]) == 0
    assert SPSProfile.load(sps).max_tokens == 2 * (GAMMA + 1)
    assert main(["eval", *common, "--prompts", str(prompts_file), "--policy", "async", "--sps",
                 str(sps), "--calibration", str(d / "dspark_calibration.json"), "--out",
                 str(tmp_path / "ev"), "--limit", "2", "--max-tokens", "12"]) == 0
    s = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert s["policy"] == "async" and s["tau"] >= 1.0
    assert "tau" in capsys.readouterr().out


@pytest.mark.parametrize("args,needle", [
    (["--prompts", "/nonexistent.jsonl"], "argument --prompts: /nonexistent.jsonl: file not found"),
    (["--prompts", "{p}", "--limit", "0"], "argument --limit: must be > 0"),
    (["--prompts", "{p}", "--device", "tpu"], "argument --device"),
    (["--prompts", "{p}", "--calibration", "/no/cal.json"], "argument --calibration"),
    (["--prompts", "{bad}"], "bad.jsonl:2: not valid JSON"),
    ([], "the following arguments are required: --prompts"),
])
def test_cli_errors_name_the_argument(tiny_target, drafter, prompts_file, tmp_path, capsys,
                                      args, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{oops\n')
    args = [a.format(p=prompts_file, bad=bad) for a in args]
    with pytest.raises(SystemExit) as e:
        main(["eval", "--target", str(tiny_target), "--drafter", str(drafter), *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--target", str(tmp_path), "--drafter", str(drafter)])
    assert "argument --target" in capsys.readouterr().err


def test_cpu_profile_key_names_the_cpu_and_threads(tiny_target, drafter):
    """A CPU profile is valid for this CPU model at this torch thread count only."""
    import torch
    dec = Decoder.from_pretrained(tiny_target, drafter)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = profiling.runner_key(dec.runner)
        torch.set_num_threads(2)
        two = profiling.runner_key(dec.runner)
    finally:
        torch.set_num_threads(before)
    assert one["model"] != two["model"] and "threads1" in one["model"]
    assert profiling.cache_path(one) != profiling.cache_path(two)
    assert profiling._cpu_model() in one["model"]
