"""lm-eval (`local-completions`) against a live `dspark-rt serve` of the shipped pair, offline: a
log-likelihood (multiple-choice) task and a generation task on local jsonl files
(tests/support/lm_eval/), run by lm-eval's own command line with the Hugging Face hub and
datasets offline. Every score it reports equals what the Decoder computes directly: a choice's
log-likelihood is the sum of its continuation tokens' prompt log-probabilities (and is_greedy
whether each is the argmax), a generation is the Decoder's greedy text up to the stop."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")

from dspark_rt import Decoder, SamplingParams  # noqa: E402
from dspark_rt.tools.serve import build_state  # noqa: E402
from tests.support.server import DRAFTER, MODEL, TARGET, _pages_back, _Server  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "support" / "lm_eval"
LIMIT = 6
MAX_GEN = 12  # dspark_tiny_gen.yaml's max_gen_toks


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """lm-eval's samples of both tasks ({task: [sample]}) and its results, from one run."""
    state = build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=8, dtype="float32")
    srv = _Server(state)
    out = tmp_path_factory.mktemp("lm_eval")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(out / "hf"),
                        "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
           "--model_args", f"model={MODEL},base_url={srv.url}/v1/completions,tokenizer={TARGET},"
           "tokenizer_backend=huggingface,max_length=512",
           "--tasks", "dspark_tiny_mc,dspark_tiny_gen", "--include_path", str(TASKS),
           "--limit", str(LIMIT), "--output_path", str(out / "results"), "--log_samples"]
    try:  # data_files are relative to the task folder
        p = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"lm-eval failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        assert _pages_back(state)
    finally:
        srv.stop()
    folder = out / "results" / MODEL
    samples = {t: [json.loads(line) for f in folder.glob(f"samples_{t}_*.jsonl")
                   for line in f.read_text().splitlines()]
               for t in ("dspark_tiny_mc", "dspark_tiny_gen")}
    results = json.loads(next(folder.glob("results_*.json")).read_text())["results"]
    return samples, results


@pytest.fixture(scope="module")
def ref():
    return Decoder.from_pretrained(TARGET, DRAFTER, dtype="float32")


@pytest.fixture(scope="module")
def hf_tok():
    """The tokenizer lm-eval encodes with (tokenizer_backend=huggingface, no special tokens)."""
    return transformers.AutoTokenizer.from_pretrained(TARGET)


def _encode_pair(tok, context, continuation):
    """The token ids lm-eval sends for a (context, continuation) pair and the context's count:
    trailing spaces of the context move to the continuation; the continuation's ids are those
    of the whole text past the context's token count, sent after the context's own ids (which
    need not be the whole text's: "range(" + "))))" encodes "())))" otherwise)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx + whole[len(ctx):], len(ctx)


def test_loglikelihood_equals_decoder(run, ref, hf_tok):
    samples, results = run
    mc = samples["dspark_tiny_mc"]
    assert len(mc) == LIMIT
    correct = []
    for s in mc:
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        got = [(float(ll), greedy == "True") for ll, greedy in s["filtered_resps"]]
        want = []
        for context, continuation in pairs:
            ids, ctx = _encode_pair(hf_tok, context, continuation)
            out = ref.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                               use_tqdm=False)[0]
            lps = [out.prompt_logprobs[p][ids[p]] for p in range(ctx, len(ids))]
            greedy = all(out.prompt_logprobs[p][ids[p]] == max(out.prompt_logprobs[p].values())
                         for p in range(ctx, len(ids)))
            want.append((sum(lps), greedy))
        assert got == want, f"doc {s['doc_id']}: lm-eval {got} != Decoder {want}"
        best = max(range(len(want)), key=lambda i: want[i][0])
        correct.append(float(best == s["doc"]["answer"]))
    assert results["dspark_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert 0 < sum(correct)  # the trained target prefers some right continuations


def test_generation_equals_decoder(run, ref, hf_tok):
    samples, results = run
    gen = samples["dspark_tiny_gen"]
    assert len(gen) == min(LIMIT, 4)
    hits = []
    for s in gen:
        ids = hf_tok(s["doc"]["context"], add_special_tokens=False).input_ids
        want = ref.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_GEN, stop=["\n"]),
                            use_tqdm=False)[0].text
        assert s["filtered_resps"][0] == want, f"doc {s['doc_id']}"
        hits.append(float(want == s["doc"]["target"]))
    assert results["dspark_tiny_gen"]["exact_match,none"] == pytest.approx(sum(hits) / len(hits))
