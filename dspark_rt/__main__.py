"""Command line: `python -m dspark_rt env|demo|calibrate|profile|eval|train|serve` (also installed as
`dspark-rt`)."""
import argparse
import importlib
import sys

# Subcommands whose arguments their own module parses (imported only when run).
TOOLS = {"calibrate": ("tools.calibrate", "fit STS temperatures of a drafter's confidence head"),
         "profile": ("tools.profile", "measure this machine's throughput profile SPS(B)"),
         "eval": ("tools.evaluate", "tau, acceptance, verify lengths, tokens/s and calibration"),
         "train": ("train.__main__", "train a tiny target and DSpark/DFlash drafters"),
         "serve": ("tools.serve", "an OpenAI-compatible HTTP server with Prometheus metrics")}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="dspark-rt", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_env = sub.add_parser("env", help="build info (CUDA compiled or not, archs) and GPU/NVML state")
    p_env.add_argument("--json", action="store_true")
    p_demo = sub.add_parser("demo", help="ar vs dflash vs dspark on a model pair")
    p_demo.add_argument("--out", default="out/demo", help="folder for the model pair and results")
    p_demo.add_argument("--quick", action="store_true", help="fewer prompts and tokens (CI)")
    p_demo.add_argument("--json", action="store_true", help="print the results as JSON")
    p_demo.add_argument("--device", default="cpu")
    for name, (_, text) in TOOLS.items():
        sub.add_parser(name, help=text + " (see --help)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd in TOOLS:
        return importlib.import_module(f".{TOOLS[args.cmd][0]}", __package__).main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "env":
        from .tools.env_info import main as env_main
        env_main(args.json)
    elif args.cmd == "demo":
        from .tools.demo import main as demo_main
        if not (args.device == "cpu" or args.device.startswith("cuda")):
            p_demo.error(f"argument --device: must be cpu or cuda[:N], got {args.device!r}")
        if args.device.startswith("cuda"):
            import torch
            if not torch.cuda.is_available():
                p_demo.error(f"argument --device: {args.device!r} but torch sees no CUDA device")
        try:
            summary = demo_main(args.out, quick=args.quick, as_json=args.json, device=args.device)
        except (ValueError, OSError, RuntimeError) as e:  # a bad folder or setting: one line
            p_demo.exit(2, f"dspark-rt demo: error: {e}\n")
        wrong = [m for m, r in (summary or {}).get("modes", {}).items() if not r["equals_ar"]]
        if wrong:  # greedy speculative output must equal plain decoding: a failed promise
            print(f"dspark-rt demo: FAILED: {', '.join(wrong)} output differs from plain decoding",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
