"""Every kernel benchmark in one process (one CUDA context, one ceiling measurement, one JSON):
verify_attention, markov_sample, rejection_sample, prefix_topk (in that order: the op a lease
most needs first), each at its goal shapes on CUDA (the shapes its bench header names; --quick:
the first two of each).

    python bench/bench_kernels.py [--device cpu|cuda] [--json PATH] [--quick] [--compile]
                                  [--flex none|one|all] [--ref all|first] [--ops markov_sample ...]

--ref first times the eager PyTorch reference at each op's first (smallest) shape only (3-4 s a
shape on CUDA; ref_us is null elsewhere). The JSON ({"header", "ops": {op: {"header", "rows",
"error"?}}, "seconds": {op: s}}) is rewritten after every row, so a run cut short by a time
limit keeps what it measured; an op that fails is recorded with the rows it had, the next one
still runs, and the exit status is 1. On a machine with a CUDA device but a dspark_rt._C
without CUDA kernels it measures nothing and exits 2: the ops would silently run the reference.
"""
import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the four bench_<op>.py beside this file

import bench_markov_sample  # noqa: E402
import bench_prefix_topk  # noqa: E402
import bench_rejection_sample  # noqa: E402
import bench_verify_attention  # noqa: E402

from dspark_rt.testing.bench import add_args, free, header  # noqa: E402

from dspark_rt import ops  # noqa: E402

BENCHES = {"verify_attention": bench_verify_attention, "markov_sample": bench_markov_sample,
           "rejection_sample": bench_rejection_sample, "prefix_topk": bench_prefix_topk}


def require_cuda_build(tool: str):
    """Exits 2 when a CUDA device is present but this build has no CUDA kernels: every op would
    fall back to the reference, and its numbers would read as the kernels'."""
    if torch.cuda.is_available() and "cuda" not in ops.available_backends():
        sys.exit(f"{tool}: a CUDA device is present but dspark_rt._C has no CUDA kernels "
                 f"(backends {ops.available_backends()}): build with DSPARK_CUDA=1 first; "
                 f"nothing measured")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    bench_verify_attention.add_flex_arg(ap)
    ap.add_argument("--ops", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    ap.add_argument("--ref", choices=["all", "first"], default="all",
                    help="shapes that time the eager reference (first: each op's smallest)")
    args = ap.parse_args(argv)
    require_cuda_build("bench_kernels")
    path, args.json = args.json, None  # the benches print; this driver writes the one JSON
    dev = torch.device(args.device)
    res = {"header": header(dev, quiet=True), "args": sys.argv[1:], "ops": {}, "seconds": {}}
    save = lambda: path and Path(path).write_text(json.dumps(res, indent=1, default=str))
    for op in args.ops:
        print(f"\n==== {op}", flush=True)
        t0 = time.perf_counter()

        def on_row(report, op=op):  # every row saved as it comes: a time limit keeps them
            res["ops"][op] = report.result()
            save()

        args.on_row = on_row
        try:
            res["ops"][op] = BENCHES[op].run(args)
        except Exception as e:  # recorded with the rows it had; the next op still runs
            traceback.print_exc()
            res["ops"][op] = dict(res["ops"].get(op, {}), error=f"{type(e).__name__}: {e}")
        res["seconds"][op] = round(time.perf_counter() - t0, 1)
        free(dev)
        save()
    failed = [op for op, r in res["ops"].items() if "error" in r]
    print(f"\nbench_kernels: {', '.join(f'{k} {v} s' for k, v in res['seconds'].items())}"
          + (f"; wrote {path}" if path else "") + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return res


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()["ops"].values()) else 0)
