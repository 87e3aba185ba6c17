"""tau of DSpark against DFlash (same backbone size, same gamma) on held-out code prompts.

    python bench/bench_tau.py                       # the shipped pair, humaneval + mbpp, 30 each
    python bench/bench_tau.py --limit 10 --json

Greedy decoding, first turn of each prompt as raw text (prompts longer than the context keep
their last tokens), eos ignored so every prompt yields max_tokens tokens; dspark runs the fixed
policy (every draft verified), so the two rows differ only by the sequential head. Both modes must
emit the same tokens (each equals plain greedy decoding); the script checks it. The prompt files
are for evaluation only.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from dspark_rt import Decoder, SamplingParams, SpecMetrics
from dspark_rt.tools.prompts import fit_length, load_prompts

PRETRAINED = ROOT / "dspark_rt" / "pretrained"
EVAL = ROOT.parent / "shared" / "data" / "eval"  # the prompt sets beside the checkout


def run(target, drafter, mode, prompts, params, batch):
    dec = Decoder.from_pretrained(str(target), str(drafter), mode=mode, policy="fixed")
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += dec.generate(prompts[i:i + batch], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    return SpecMetrics.merged(o.metrics for o in outs), [o.token_ids for o in outs], secs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=PRETRAINED / "target")
    ap.add_argument("--dspark", default=PRETRAINED / "dspark")
    ap.add_argument("--dflash", default=PRETRAINED / "dflash")
    ap.add_argument("--prompts", nargs="+", default=[EVAL / "humaneval.jsonl", EVAL / "mbpp.jsonl"])
    ap.add_argument("--limit", type=int, default=30, help="prompts per file")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (tiny models: 1 is fastest)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    probe = Decoder.from_pretrained(str(a.target), str(a.dspark), mode="dspark")
    rows = []
    for path in a.prompts:
        prompts = load_prompts(path, probe.tokenizer, limit=a.limit,
                               max_prompt_tokens=fit_length(probe, a.max_tokens))
        res = {}
        for mode, drafter in (("dflash", a.dflash), ("dspark", a.dspark)):
            m, ids, secs = run(a.target, drafter, mode, prompts, params, a.batch)
            res[mode] = {"tau": m.mean_acceptance_length, "rounds": m.num_rounds,
                         "acceptance_by_position": m.acceptance_by_position, "seconds": secs,
                         "ids": ids}
        same = res["dflash"].pop("ids") == res["dspark"].pop("ids")
        rows.append({"prompts": str(path), "n": len(prompts), "equal_outputs": same,
                     "tau_dflash": res["dflash"]["tau"], "tau_dspark": res["dspark"]["tau"],
                     "ratio": res["dspark"]["tau"] / res["dflash"]["tau"], "detail": res})
    if a.json:
        print(json.dumps(rows, indent=2, default=str))
        return rows
    print(f"target {a.target}\ngreedy, max_tokens {a.max_tokens}, gamma {probe.runner.gamma}, "
          f"first {a.limit} prompts per file, dspark with the fixed policy")
    print(f"{'prompts':24} {'n':>3} {'tau dflash':>10} {'tau dspark':>10} {'ratio':>6}  "
          "same tokens")
    for r in rows:
        print(f"{Path(r['prompts']).name:24} {r['n']:3d} {r['tau_dflash']:10.3f} "
              f"{r['tau_dspark']:10.3f} {r['ratio']:6.3f}  {r['equal_outputs']}")
        for mode in ("dflash", "dspark"):
            acc = " ".join(f"{x:.2f}" for x in r["detail"][mode]["acceptance_by_position"])
            print(f"    {mode} acceptance by position: {acc}")
    return rows


if __name__ == "__main__":
    main()
