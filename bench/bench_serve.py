"""Requests/s and tokens/s of `dspark-rt serve` at 1, 8, 32, 128 concurrent streams, against the
same load through the Python API (one Engine stepped in this process), so that the HTTP overhead
is a measured ratio.

    python bench/bench_serve.py                         # the shipped pair, humaneval prompts
    python bench/bench_serve.py --levels 1 8 --json

Load: each of `concurrency` workers sends its next request as soon as the last one finished
(closed loop) until `requests` are done, `--repeats` times alternating with the Python run
(medians reported); a request is a token-id prompt (the first turn of a
humaneval prompt, cut to fit), greedy, eos ignored, `--max-tokens` new tokens, streamed (SSE,
read by httpx). The server runs as a subprocess (`python -m dspark_rt serve`, the same Engine
sizes as the Python run: max_num_seqs = the largest level); both sides use `--threads` torch
threads. The load generator shares the machine with the server: on a small CPU its cost is part
of the measured overhead.
"""
import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_rt import Decoder, SamplingParams  # noqa: E402
from dspark_rt.engine import EngineConfig  # noqa: E402
from dspark_rt.tools.prompts import fit_length, load_prompts  # noqa: E402

PRETRAINED = ROOT / "dspark_rt" / "pretrained"
EVAL = ROOT.parent / "shared" / "data" / "eval"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_api(dec, cfg, prompts, n_req, conc, max_tokens):
    """Closed loop of `conc` in-flight requests on one Engine; (seconds, tokens)."""
    eng = dec.new_engine(cfg)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sent = done = tokens = 0
    t0 = time.perf_counter()
    while done < n_req:
        while sent < n_req and sent - done < conc:
            eng.add(eng.make_request(prompts[sent % len(prompts)], params))
            sent += 1
        for o in eng.step():
            tokens += len(o.new_token_ids)
            done += o.finished
    return time.perf_counter() - t0, tokens


async def http_load(url, prompts, n_req, conc, max_tokens):
    import httpx
    next_i, tokens = 0, 0

    async def worker(client):
        nonlocal next_i, tokens
        while next_i < n_req:
            i, next_i = next_i, next_i + 1
            body = {"model": "bench", "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        tokens += json.loads(line[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(conc)))
        return time.perf_counter() - t0, tokens


def start_server(target, drafter, max_num_seqs, threads):
    import httpx
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "dspark_rt", "serve", "--target", str(target),
                             "--drafter", str(drafter), "--port", str(port), "--served-model-name",
                             "bench", "--max-num-seqs", str(max_num_seqs), "--dtype", "float32",
                             "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=PRETRAINED / "target")
    ap.add_argument("--drafter", default=PRETRAINED / "dspark")
    ap.add_argument("--prompts", default=EVAL / "humaneval.jsonl")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 32, 64, 256],
                    help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs per level (median reported)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dec = Decoder.from_pretrained(str(a.target), str(a.drafter), dtype="float32")
    prompts = load_prompts(a.prompts, dec.tokenizer, limit=64,
                           max_prompt_tokens=min(256, fit_length(dec, a.max_tokens)))
    top = max(a.levels)
    per_seq = -(-(dec.max_model_len + dec.runner.gamma + 2) // dec.runner.page_size)
    budget = max(2048, top * (1 + dec.runner.gamma))  # what `serve` configures
    cfg = EngineConfig(num_pages=top * per_seq, max_num_seqs=top, max_num_batched_tokens=budget,
                       chunk_size=min(budget, 512))
    python_api(dec, cfg, prompts, 4, 4, 8)  # warm-up
    rows = []
    proc, url = start_server(a.target, a.drafter, top, a.threads)
    try:
        asyncio.run(http_load(url, prompts, 4, 4, 8))  # warm-up
        for conc, n_req in zip(a.levels, a.requests):
            api, http = [], []
            for _ in range(a.repeats):  # alternated, so that a load spike hits both sides
                s_api, tok_api = python_api(dec, cfg, prompts, n_req, conc, a.max_tokens)
                s_http, tok_http = asyncio.run(http_load(url, prompts, n_req, conc, a.max_tokens))
                assert tok_api == tok_http == n_req * a.max_tokens, (tok_api, tok_http)
                api.append(s_api)
                http.append(s_http)
            s_api, s_http = statistics.median(api), statistics.median(http)
            tok = n_req * a.max_tokens
            rows.append(dict(concurrency=conc, requests=n_req, api_req_s=n_req / s_api,
                             api_tok_s=tok / s_api, http_req_s=n_req / s_http,
                             http_tok_s=tok / s_http, http_over_api=s_api / s_http,
                             api_seconds=api, http_seconds=http))
            r = rows[-1]
            if not a.json:
                print(f"streams {conc:4d}  requests {n_req:4d}  python API {r['api_req_s']:7.2f} req/s "
                      f"{r['api_tok_s']:8.1f} tok/s   HTTP {r['http_req_s']:7.2f} req/s "
                      f"{r['http_tok_s']:8.1f} tok/s   HTTP/API {r['http_over_api']:.2f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    if a.json:
        print(json.dumps({"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                      "threads": a.threads, "load_avg": os.getloadavg()},
                          "max_tokens": a.max_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
