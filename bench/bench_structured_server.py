"""Structured output through the server, with the `openai` client: tau and tokens/s without a
grammar and under bench_structured.py's JSON schema and regex, and whether a large schema's
compile holds up other requests' streams.

    python bench/bench_structured_server.py                  # the shipped pair, 20 prompts
    python bench/bench_structured_server.py --limit 8 --json

A `dspark-rt serve --target shipped --drafter shipped` subprocess (one torch thread, dspark
fixed, float32) on a free port. --concurrency client threads send the prompts (greedy, cut to
--chars characters); tau comes from each response's speculative metrics. Then the stall probe: a
plain request streams --probe-tokens tokens while a request with a schema of --schema-fields
properties, never seen by the server, is sent; the stream's largest gap between chunks while
that schema compiles is printed beside its median gap and the compile-bound request's time to
its first chunk.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_structured import EVAL, GRAMMARS, SCHEMA

from dspark_rt.tools.prompts import read_turns

MODEL = "tiny"
WAYS = {"none": {}, "json": {"guided_json": SCHEMA},
        "regex": {"guided_regex": GRAMMARS["regex"].regex}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dspark_rt", "serve", "--target", "shipped", "--drafter", "shipped",
           "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up within 120 s")


def run(client, prompts, extra, max_tokens, concurrency):
    def one(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
                                      extra_body=dict(extra, ignore_eos=not extra))
        m = r.model_extra["metrics"]["speculative_decoding"]
        return r.usage.completion_tokens, m["num_spec_steps"], m["num_accepted_draft_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, prompts))
    secs = time.perf_counter() - t0
    tokens, steps, accepted = (sum(c) for c in zip(*rows))
    return {"tau": 1 + accepted / max(steps, 1), "tokens": tokens, "tokens_per_s": tokens / secs}


def big_schema(n: int) -> dict:
    item = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"enum": ["x", "y"]}}}
    props = {f"field_{time.time_ns()}_{i}": {"type": ["string", "integer", "array"], "items": item}
             for i in range(n)}
    return {"type": "object", "properties": props, "required": sorted(props)[:4]}


def stall_probe(client, prompt, tokens, fields):
    """(median gap, largest gap while the schema compiled, the schema request's first chunk)."""
    stamps, first = [], {}

    def schema_request():
        t0 = time.perf_counter()
        for _ in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True, extra_body={"guided_json": big_schema(fields)}):
            first.setdefault("s", time.perf_counter() - t0)
            first.setdefault("at", time.perf_counter())
        first["sent"] = t0

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    other = None
    for i, _ in enumerate(stream):
        stamps.append(time.perf_counter())
        if i == 20:
            other = threading.Thread(target=schema_request)
            other.start()
    other.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if first["sent"] <= b and a <= first["at"]]
    return statistics.median(gaps), max(during or [0.0]), first["s"], len(during)


def main(argv=None):
    import openai
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=EVAL / "humaneval.jsonl")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--probe-tokens", type=int, default=400)
    ap.add_argument("--schema-fields", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    prompts = [t[0][:a.chars] for t in read_turns(a.prompts, a.limit)]
    port = free_port()
    proc = start_server(port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        run(client, prompts[:a.concurrency], WAYS["json"], 8, a.concurrency)  # warm-up
        rows = {name: run(client, prompts, extra, a.max_tokens, a.concurrency)
                for name, extra in WAYS.items()}
        med, worst, first, n = stall_probe(client, prompts[0], a.probe_tokens, a.schema_fields)
        rows["stall"] = {"median_gap_ms": 1e3 * med, "max_gap_during_compile_ms": 1e3 * worst,
                         "schema_first_chunk_s": first, "gaps_during_compile": n}
    finally:
        proc.terminate()
        proc.wait(30)
    if a.json:
        print(json.dumps(rows, indent=2))
        return rows
    print(f"dspark-rt serve, shipped pair, float32, dspark fixed, 1 thread; openai client, "
          f"{len(prompts)} prompts of {Path(a.prompts).name}, {a.concurrency} at a time, greedy")
    print(f"{'grammar':8} {'tau':>6} {'tokens':>7} {'tok/s':>8}")
    for name in WAYS:
        r = rows[name]
        print(f"{name:8} {r['tau']:6.3f} {r['tokens']:7d} {r['tokens_per_s']:8.1f}")
    s = rows["stall"]
    print(f"a stream's chunks: median gap {s['median_gap_ms']:.1f} ms; largest gap while a "
          f"{a.schema_fields}-property schema compiled {s['max_gap_during_compile_ms']:.1f} ms "
          f"({s['gaps_during_compile']} chunks); that request's first chunk after "
          f"{s['schema_first_chunk_s']:.2f} s")
    return rows


if __name__ == "__main__":
    main()
