"""An OpenAI-compatible HTTP server over one Engine (`dspark-rt serve`).

protocol: request bodies -> prompt, SamplingParams, options (or an OpenAI error);
responses: the OpenAI JSON of outputs and stream chunks, per-request speculative metrics;
engine_loop: the background thread that owns and steps the Engine;
metrics: Prometheus counters and histograms (`dspark_rt:` prefix);
app: the FastAPI routes. Needs the `serve` extra (fastapi, uvicorn, prometheus-client).
"""
from .app import ServerState, build_app

__all__ = ["ServerState", "build_app"]
