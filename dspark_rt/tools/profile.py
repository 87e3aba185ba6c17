"""`dspark-rt profile`: measure a model pair's throughput profile SPS(B) now and save it."""
from pathlib import Path

from ..decoder import Decoder
from ..policies.sps import SPSProfile
from ..runner.profiling import cache_path, profile_runner
from .prompts import parse_tool_args, positive, run_tool, tool_parser


def profile_command(target, drafter, out=None, *, seconds=None, max_batch=None, context_len=None,
                    device="cpu", dtype=None, progress=True) -> SPSProfile:
    """Measure now (never reuse) and save to `out`, or to the cache load_or_profile reads."""
    dec = Decoder.from_pretrained(target, drafter, device=device, dtype=dtype)
    prof = profile_runner(dec.runner, seconds=seconds, context_len=context_len, max_batch=max_batch,
                          progress=progress)
    path = Path(out) if out is not None else cache_path(prof.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.save(path)
    print(f"SPS(B) of {prof.key['model']} ({prof.key['dtype']}, GPU {prof.key['gpu_name']}), "
          f"rounds/s:")
    for b, v in zip(prof.tokens, prof.rounds_per_s):
        print(f"  B={b:<5d} {v:10.1f}")
    print(f"wrote {path}")
    return prof


def main(argv=None) -> int:
    ap = tool_parser("profile", "Measure this machine's throughput profile SPS(B) for a model "
                     "pair (rounds per second against B verify tokens).", prompts=False)
    ap.add_argument("--out", help="JSON path (default: the profile cache, $DSPARK_CACHE_DIR or "
                    "~/.cache/dspark_rt, where eval and load_or_profile find it)")
    ap.add_argument("--seconds", type=positive(float), help="measuring budget (30 GPU / 3 CPU)")
    ap.add_argument("--max-batch", type=positive(int), help="requests in the largest round "
                    "(32 GPU / 8 CPU); max B = max_batch * (gamma + 1)")
    ap.add_argument("--context-len", type=positive(int), help="context tokens per request "
                    "(1024 GPU / 128 CPU)")
    a = parse_tool_args(ap, argv)
    return run_tool(ap, profile_command, a.target, a.drafter, a.out, seconds=a.seconds,
                    max_batch=a.max_batch, context_len=a.context_len, device=a.device,
                    dtype=a.dtype)
