"""`dspark-rt serve`: an OpenAI-compatible HTTP server (dspark_rt.server) over one Engine.

FastAPI on uvicorn: the stack vLLM and SGLang serve with, so the error shapes, streaming and
client behaviour users already know come with it; one engine thread steps the Engine while the
event loop takes requests concurrently.
"""
import argparse
import logging
import socket
from pathlib import Path

from ..policies import POLICIES
from .prompts import DTYPES, byte_size, model_dir, positive

log = logging.getLogger("dspark_rt.server")

CALIBRATION = "dspark_calibration.json"  # what `dspark-rt calibrate` writes next to the drafter


def build_state(target, drafter=None, *, mode=None, policy="fixed", threshold=0.5,
                calibration=None, served_model_name=None, max_num_seqs=32, num_pages=None,
                max_num_batched_tokens=None, max_waiting=1024, device="cpu", dtype=None, seed=0,
                tensor_parallel_size=1, max_body_bytes=None, kv_cache_memory=None,
                kv_cache_fraction=None, log_stats_interval=0.0):
    """The Decoder's models, a fresh Engine of these sizes, and the server state over it.
    num_pages (default): what kv_cache_memory bytes, or kv_cache_fraction of the memory left
    after loading, hold (kv_budget), up to max_num_seqs whole contexts. The state's `summary`:
    what was loaded, in words (the startup line)."""
    from ..decoder import Decoder
    from ..engine import EngineConfig
    from ..server import ServerState
    from .kv_budget import budget_pages, gib, page_bytes

    if calibration is None and drafter is not None and (Path(drafter) / CALIBRATION).is_file():
        calibration = Path(drafter) / CALIBRATION
    dec = Decoder.from_pretrained(target, drafter, device=device, dtype=dtype, mode=mode,
                                  policy=policy, threshold=threshold, calibration=calibration,
                                  seed=seed, tensor_parallel_size=tensor_parallel_size)
    per_seq = -(-(dec.max_model_len + dec.runner.gamma + 2) // dec.runner.page_size)
    if num_pages is None:
        num_pages = budget_pages(dec.runner, dec.device, per_seq=per_seq,
                                 max_num_seqs=max_num_seqs, max_model_len=dec.max_model_len,
                                 kv_cache_memory=kv_cache_memory,
                                 kv_cache_fraction=kv_cache_fraction)
    budget = max_num_batched_tokens or max(2048, max_num_seqs * (1 + dec.runner.gamma))
    config = EngineConfig(num_pages=num_pages, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, chunk_size=min(budget, 512))
    try:
        eng = dec.new_engine(config)
    except (RuntimeError, MemoryError) as e:  # torch's allocators: OutOfMemoryError and kin
        if "alloc" not in str(e).lower() and "memory" not in str(e).lower():
            raise
        size = gib(num_pages * page_bytes(dec.runner))
        raise ValueError(f"allocating the KV caches ({num_pages} pages, {size}) failed: lower "
                         f"--num-pages or --kv-cache-memory ({str(e).splitlines()[0]})") from None
    state = ServerState(eng, dec.tokenizer, served_model_name or str(target), dec.max_model_len,
                        max_waiting=max_waiting, max_body_bytes=max_body_bytes,
                        log_interval=log_stats_interval)
    state.summary = summary(dec, eng, target, drafter, state.model_name)
    return state


def summary(dec, eng, target, drafter, served_name: str) -> str:
    """target, drafter, mode, policy, dtype, calibration source and KV pages, in one line."""
    r = dec.runner
    dtype = str(dec.target.dtype).removeprefix("torch.")
    pages = (f"KV cache {eng.num_pages} pages of {r.page_size} tokens per cache "
             f"({eng.num_pages * r.page_size} tokens), max {eng.config.max_num_seqs} sequences")
    spec = (f"drafter {drafter} (gamma {r.gamma}), mode {dec.mode}, policy {eng.policy.name}, "
            f"calibration {dec.calibration_source or 'none'}" if drafter else
            f"no drafter, mode {dec.mode}")
    tp = dec.tensor_parallel
    ranks = f", {tp.size} tensor-parallel ranks" if tp is not None else ""
    return (f"serving {served_name!r}: target {target} ({dtype} on {dec.device}{ranks}), {spec}, "
            f"{pages}")


def port(s) -> int:
    """argparse type: a TCP port number."""
    v = positive(int)(s)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {s}")
    return v


def fraction(s) -> float:
    """argparse type: a number in (0, 1]."""
    v = positive(float)(s)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {s}")
    return v


def shipped_or_dir(kind: str):
    """argparse type: a model folder, or `shipped`: the package's own pretrained/<kind> folder
    (the tiny pair `dspark-rt demo` runs, package data of an installed dspark_rt)."""
    def parse(s):
        if s != "shipped":
            return model_dir(s)
        from importlib.resources import files
        return model_dir(str(files("dspark_rt") / "pretrained" / kind))
    return parse


def seconds(s) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {s!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def check_listen(ap, host: str, port: int):
    """Exits with a clear error when host:port cannot be listened on (a bad host, a port in use
    or reserved), before any model is loaded."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind((host, port))
    except OSError as e:
        ap.error(f"argument --host/--port: cannot listen on {host}:{port} "
                 f"({e.strerror or e})")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dspark-rt serve", description="An OpenAI-compatible server "
                                 "(/v1/completions, /v1/chat/completions, /v1/models, /health, "
                                 "/metrics, /tokenize, /detokenize, /version) over one continuous-batching Engine.")
    ap.add_argument("--target", required=True, type=shipped_or_dir("target"),
                    help="target model folder, or `shipped`: the package's tiny target")
    ap.add_argument("--drafter", type=shipped_or_dir("dspark"), help="drafter folder, or "
                    "`shipped`: the package's tiny DSpark drafter (none: plain decoding)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port, default=8000)
    ap.add_argument("--served-model-name", help="the model name clients send (default: --target)")
    ap.add_argument("--mode", choices=["ar", "dflash", "dspark"], help="default: by the drafter")
    ap.add_argument("--policy", default="fixed", choices=sorted(POLICIES),
                    help="verify-length policy of dspark mode (default: fixed)")
    ap.add_argument("--threshold", type=float, default=0.5, help="for --policy threshold")
    ap.add_argument("--calibration", help=f"STS temperatures (default: <drafter>/{CALIBRATION} "
                    "when present)")
    ap.add_argument("--max-num-seqs", type=positive(int), default=32, help="requests per batch")
    kv = ap.add_mutually_exclusive_group()
    kv.add_argument("--num-pages", type=positive(int), help="KV pages per cache (default: what "
                    "the KV cache budget holds, up to max-num-seqs whole contexts)")
    kv.add_argument("--kv-cache-memory", type=byte_size, help="KV cache budget in bytes, both "
                    "caches together (e.g. 2GiB)")
    kv.add_argument("--kv-cache-fraction", type=fraction, help="KV cache budget as a fraction of "
                    "the memory available after loading (default: 0.9 on CUDA, 0.5 on the CPU)")
    ap.add_argument("--max-num-batched-tokens", type=positive(int), help="target tokens per step")
    ap.add_argument("--max-waiting", type=positive(int), default=1024, help="queued requests "
                    "before new ones get 503 (Retry-After)")
    ap.add_argument("--max-body-bytes", type=byte_size,
                    help="larger request bodies get 413 (default: 16MiB; units: KiB, MiB, GB...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=DTYPES)
    ap.add_argument("--seed", type=int, default=0, help="Philox key of requests without a seed")
    ap.add_argument("--tensor-parallel-size", type=positive(int), default=1,
                    help="ranks to shard the models over (this process and N - 1 workers; "
                    "NCCL on CUDA, gloo on the CPU)")
    ap.add_argument("--log-stats-interval", type=seconds, default=10.0, metavar="SECONDS",
                    help="seconds between stats lines (throughput, queue, KV usage, acceptance "
                    "length) in the log; 0: none")
    ap.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug", "trace"])
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    try:
        import uvicorn

        from ..server import build_app
    except ImportError as e:
        ap.exit(2, f"dspark-rt serve: {e.name} is missing: pip install 'dspark_rt[serve]'\n")
    check_listen(ap, a.host, a.port)
    logging.basicConfig(level=a.log_level.upper())
    try:
        state = build_state(a.target, a.drafter, mode=a.mode, policy=a.policy,
                            threshold=a.threshold, calibration=a.calibration,
                            served_model_name=a.served_model_name, max_num_seqs=a.max_num_seqs,
                            num_pages=a.num_pages, max_num_batched_tokens=a.max_num_batched_tokens,
                            max_waiting=a.max_waiting, device=a.device,
                            dtype=None if a.dtype == "auto" else a.dtype, seed=a.seed,
                            tensor_parallel_size=a.tensor_parallel_size,
                            max_body_bytes=a.max_body_bytes, kv_cache_memory=a.kv_cache_memory,
                            kv_cache_fraction=a.kv_cache_fraction,
                            log_stats_interval=a.log_stats_interval)
    except (ValueError, OSError) as e:
        ap.exit(2, f"dspark-rt serve: error: {e}\n")
    log.info("%s; listening on http://%s:%d", state.summary, a.host, a.port)
    uvicorn.run(build_app(state), host=a.host, port=a.port, log_level=a.log_level)
    return 0
