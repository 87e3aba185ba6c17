"""Tensor parallelism on this machine: tokens/s of N ranks against one process, bytes the
collectives move per decoding round against the floor, and weights per rank.

    python bench/bench_tp.py                      # the shipped pair, float32, CPU, 1 vs 2 ranks
    python bench/bench_tp.py --tp 2 4 --json

Greedy dspark (fixed policy: every draft verified) on R prompts; the first step prefills them
all, the following steps are decoding rounds only, so the traffic counted between them is the
rounds'. Per round, with n_v verify rows, R requests, block B, d hidden, L_t / L_d layers, V
vocabulary, b bytes per element (payload handed to the collectives by one rank; a ring moves
2 (N-1)/N of an all-reduce's and (N-1)/N of an all-gather's total per rank, i.e. the payload at N = 2):
  measured = all-reduces (2 L + 1) x rows x d x b  (o_proj, down_proj, embedding) of both forwards
           + all-gathers of the LM-head shards     (n_v + R gamma) x V / N x b
           + broadcasts of the host reads, commands (pickled SeqBatch and Decision)
  floor    = 2 L x rows x d x b of both forwards (a Megatron layer cannot combine less: its output
             needs every head's and every MLP slice's share) + a few scalars per logits row
             (sampling from vocabulary shards needs each shard's max / log-sum-exp / chosen
             entries, not the shard).
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
PRETRAINED = ROOT / "dspark_rt" / "pretrained"
TEXTS = ["def quicksort(xs):", "import os\n\nclass Config:", "for i in range(10):",
         "def read_json(path):", "class Node:\n    def __init__(self, value):",
         "with open(path) as f:", "def fib(n):", "import re\n\ndef tokenize(text):"]


def run(tp: int, args) -> dict:
    dec = Decoder.from_pretrained(args.target, args.drafter, mode="dspark", policy="fixed",
                                  dtype=args.dtype, tensor_parallel_size=tp)
    try:
        prompts = [dec.tokenizer.encode(t) for t in TEXTS[: args.requests]]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        dec.generate(prompts, params, use_tqdm=False)  # warm-up
        best = None
        for _ in range(args.repeats):
            eng = dec.new_engine(EngineConfig(num_pages=256, max_num_seqs=len(prompts)))
            ids = [eng.add_request(p, params) for p in prompts]
            t0 = time.perf_counter()
            eng.step()  # prefill of every prompt, and its first token
            before = _traffic(dec) if tp > 1 else None
            r0 = eng.num_rounds
            dec.round_log = log = []
            outs = {}
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        outs[o.request_id] = o.output
            seconds = time.perf_counter() - t0
            tokens = sum(len(outs[i].token_ids) for i in ids)
            res = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                   "rounds": eng.num_rounds - r0,
                   "verify_rows": sum(sum(l + 1 for l in e["lengths"]) for e in log),
                   "requests_per_round": sum(len(e["lengths"]) for e in log) / max(1, len(log))}
            if tp > 1:
                after = _traffic(dec)
                res["bytes"] = {k: after[k] - before[k] for k in after if k != "calls"}
            if best is None or res["tokens_per_s"] > best["tokens_per_s"]:
                best = res
        best["token_ids"] = [outs[i].token_ids for i in ids]
        if tp > 1:
            best["weights_per_rank"] = [s["weights"] for s in dec.tensor_parallel.stats()]
        else:
            best["weights_per_rank"] = [sum(t.numel() * t.element_size() for m in (dec.target, dec.drafter)
                                            for t in list(m.parameters()) +
                                            [b for b in m.buffers() if b is not None])]
        best["floor_per_round"], best["model_per_round"] = _floor(dec, best, tp)
        return best
    finally:
        dec.shutdown()
        if tp > 1:
            print(f"# worker exit codes: {[p.poll() for p in dec.tensor_parallel.procs]}",
                  file=sys.stderr)


def _traffic(dec) -> dict:
    return dec.tensor_parallel.group.traffic.as_dict()


def _floor(dec, res, tp):
    """(floor, the sharded model's own collectives) in bytes per round, from the shapes."""
    t, d = dec.target.config, dec.target.config.hidden_size
    b = dec.target.dtype.itemsize
    L_d = dec.drafter.config.num_hidden_layers
    R, B, g = res["requests_per_round"], dec.runner.block_size, dec.runner.gamma
    rows_v = res["verify_rows"] / max(1, res["rounds"])
    rows_d = R * B
    floor = 2 * (t.num_hidden_layers * rows_v + L_d * rows_d) * d * b + 4 * (rows_v + R * g) * 8
    model = ((2 * t.num_hidden_layers + 1) * rows_v + (2 * L_d + 1) * rows_d) * d * b \
        + (rows_v + R * g) * (-(-t.vocab_size // max(tp, 1))) * b
    return floor, model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(PRETRAINED / "target"))
    ap.add_argument("--drafter", default=str(PRETRAINED / "dspark"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 1, 2],
                    help="rank counts, run in this order (repeats interleave, on a shared machine)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    head = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads_rank0": torch.get_num_threads(),
            "load_avg": os.getloadavg()}
    results = [(tp, run(tp, args)) for tp in args.tp]  # repeat a count to interleave runs
    same = all(r["token_ids"] == results[0][1]["token_ids"] for _, r in results)
    if args.json:
        print(json.dumps({"header": head, "same_tokens": same, "runs": [
            {"tp": k, **{kk: vv for kk, vv in v.items() if kk != "token_ids"}} for k, v in results]},
            indent=1))
        return
    print(f"# {head}")
    print(f"tokens equal across ranks counts: {same}")
    base = results[0][1]["tokens_per_s"]
    for tp, r in results:
        line = (f"TP={tp}: {r['tokens_per_s']:.1f} tok/s ({r['tokens_per_s'] / base:.2f}x), "
                f"{r['rounds']} rounds, weights/rank {r['weights_per_rank'][0] / 2**20:.2f} MiB")
        if tp > 1:
            per = {k: v / r["rounds"] for k, v in r["bytes"].items()}
            total = sum(per.values())
            line += (f"\n  bytes/round: all_reduce {per['all_reduce']:.0f}, all_gather "
                     f"{per['all_gather']:.0f}, broadcast {per['broadcast']:.0f}, commands "
                     f"{per['commands']:.0f}; total {total:.0f} (model's collectives by shape "
                     f"{r['model_per_round']:.0f}); floor {r['floor_per_round']:.0f} "
                     f"({total / r['floor_per_round']:.2f}x the floor)")
        print(line)


if __name__ == "__main__":
    main()
