"""What Gumbel-coupled acceptance costs: tau and the draft acceptance rate of coupled requests
against the default rejection rule (DESIGN §2 step 6 vs "coupled sampling").

    python bench/bench_coupled.py                  # the shipped pair, 30 humaneval prompts
    python bench/bench_coupled.py --limit 10 --json

Same prompts, seeds, drafts policy and sampling for both rules: dspark with the fixed policy
(every draft verified, gamma = the drafter's block size), first turn of each prompt cut to
--chars characters, eos ignored so every prompt yields max_tokens tokens, request i seeded i.
The rejection rule accepts with probability 1 - TV(P, q) per position; the coupled rule with
P(x = y) >= (1 - TV) / (1 + TV), in exchange for output that equals seeded plain decoding.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from dspark_rt import Decoder, SamplingParams, SpecMetrics
from dspark_rt.tools.prompts import read_turns

PRETRAINED = ROOT / "dspark_rt" / "pretrained"
EVAL = ROOT.parent / "shared" / "data" / "eval"  # the project's shared data, beside the repo


def run(dec, prompts, temperature, coupled, max_tokens, batch):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                             ignore_eos=True, coupled=coupled) for i in range(len(prompts))]
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += dec.generate(prompts[i:i + batch], params[i:i + batch], use_tqdm=False)
    return SpecMetrics.merged(o.metrics for o in outs), time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=PRETRAINED / "target")
    ap.add_argument("--drafter", default=PRETRAINED / "dspark")
    ap.add_argument("--prompts", default=EVAL / "humaneval.jsonl")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--chars", type=int, default=400, help="first turn cut to this many chars")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dec = Decoder.from_pretrained(str(a.target), str(a.drafter), mode="dspark", policy="fixed",
                                  dtype="float32")
    prompts = [dec.tokenizer.encode(t[0][:a.chars]) for t in read_turns(a.prompts, a.limit)]
    rows = []
    for T in a.temperatures:
        for rule in ("rejection", "coupled"):
            m, secs = run(dec, prompts, T, rule == "coupled", a.max_tokens, a.batch)
            rows.append({"temperature": T, "rule": rule, "tau": m.mean_acceptance_length,
                         "draft_acceptance_rate": m.draft_acceptance_rate,
                         "acceptance_by_position": m.acceptance_by_position,
                         "rounds": m.num_rounds, "seconds": secs})
    if a.json:
        print(json.dumps(rows, indent=2))
        return rows
    print(f"target {a.target}, drafter {a.drafter}\nfloat32, dspark fixed policy, gamma "
          f"{dec.runner.gamma}, {len(prompts)} prompts of {Path(a.prompts).name} (first turn, "
          f"{a.chars} chars), {a.max_tokens} tokens each, seeds 0..{len(prompts) - 1}")
    print(f"{'T':>4} {'rule':10} {'tau':>6} {'accept rate':>11} {'rounds':>6}  acceptance by position")
    for r in rows:
        acc = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"])
        print(f"{r['temperature']:4.1f} {r['rule']:10} {r['tau']:6.3f} "
              f"{r['draft_acceptance_rate']:11.3f} {r['rounds']:6d}  {acc}")
    return rows


if __name__ == "__main__":
    main()
