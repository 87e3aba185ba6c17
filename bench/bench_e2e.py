"""End-to-end decoding: ar vs dflash vs dspark (fixed / sync / async) against batch size.

Per mode and batch size: tokens/s, per-user tokens/s, tau (tokens per round, bonus included),
mean verify length, and the per-round time split (draft forward, sequential head, scheduling,
verify forward, acceptance, drafter context update, the rest = commit and bookkeeping). CPU: the
shipped tiny pair (real acceptance). JSON with --json and a plot of throughput against per-user
speed with --plot.

    python bench/bench_e2e.py [--batch 1 4 16] [--max-tokens 48] [--json out.json] [--plot out.png]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_rt import Decoder, SamplingParams  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "dspark_rt" / "pretrained"
PROMPTS = ["def merge_sort(xs):\n", "import json\n\ndef load(path):\n", "class Queue:\n    def __init__(self):\n",
           "for i in range(10):\n", "def parse_args(argv):\n", "with open(path) as f:\n",
           "try:\n    import numpy\n", "def fib(n):\n    if n < 2:\n"]
MODES = [("ar", "fixed"), ("dflash", "fixed"), ("dspark", "fixed"), ("dspark", "sync"), ("dspark", "async")]


def run(mode, policy, batch, max_tokens, device):
    drafter = None if mode == "ar" else PAIR / ("dflash" if mode == "dflash" else "dspark")
    dec = Decoder.from_pretrained(PAIR / "target", drafter, mode=mode, policy=policy, device=device,
                                  calibration=(PAIR / "dspark" / "dspark_calibration.json") if mode == "dspark" else None)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    dec.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    dec.runner.phase_times = {}
    t0 = time.perf_counter()
    outs = dec.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    rounds = max(o.metrics.num_rounds for o in outs) or max(len(o.token_ids) for o in outs)
    phases = dict(dec.runner.phase_times)
    phases["other"] = max(0.0, secs - sum(phases.values()))
    m = [o.metrics for o in outs]
    verified = sum(x.num_draft_tokens for x in m)
    n_rounds = sum(x.num_rounds for x in m)
    return {"mode": mode, "policy": policy, "batch": batch, "tokens": tokens, "seconds": secs,
            "tokens_per_s": tokens / secs, "per_user_tokens_per_s": tokens / secs / batch,
            "tau": (sum(x.num_accepted_tokens for x in m) + n_rounds) / n_rounds if n_rounds else 1.0,
            "mean_verify_length": verified / n_rounds if n_rounds else 0.0,
            "rounds": rounds, "phase_share": {k: v / secs for k, v in phases.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # two shared cores: one thread is steadier (see bench/RESULTS.md)
    rows = []
    print(f"{'mode':14} {'batch':>5} {'tok/s':>8} {'user tok/s':>10} {'tau':>5} {'verify':>6}  "
          "phase shares (draft, head, sched, verify, accept, ctx, other)")
    for mode, policy in MODES:
        for b in args.batch:
            r = run(mode, policy, b, args.max_tokens, args.device)
            rows.append(r)
            ps = r["phase_share"]
            share = " ".join(f"{ps.get(k, 0.0):.2f}" for k in ("draft_forward", "sequential_head", "schedule",
                                                               "verify_forward", "accept", "context_update", "other"))
            print(f"{mode + '/' + policy:14} {b:5d} {r['tokens_per_s']:8.1f} {r['per_user_tokens_per_s']:10.1f} "
                  f"{r['tau']:5.2f} {r['mean_verify_length']:6.2f}  {share}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, policy in MODES:
            pts = [r for r in rows if r["mode"] == mode and r["policy"] == policy]
            ax.plot([r["per_user_tokens_per_s"] for r in pts], [r["tokens_per_s"] for r in pts], "o-",
                    label=f"{mode}/{policy}")
            for r in pts:
                ax.annotate(str(r["batch"]), (r["per_user_tokens_per_s"], r["tokens_per_s"]), fontsize=7)
        ax.set_xlabel("per-user tokens/s")
        ax.set_ylabel("total tokens/s")
        ax.set_title(f"throughput vs per-user speed ({args.device}; labels: batch size)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return rows


if __name__ == "__main__":
    main()
