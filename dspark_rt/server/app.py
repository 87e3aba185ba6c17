"""The HTTP routes (FastAPI on Starlette): /health, /version, /v1/models, /v1/completions,
/v1/chat/completions (whole or streamed as server-sent events ending in [DONE]), /tokenize,
/detokenize and /metrics.

A request is checked (protocol), queued on the engine thread (engine_loop), then read from its
own queue: whole, or chunk by chunk. A client that goes away aborts its request: the streaming
response is cancelled by Starlette on disconnect; a whole response races its collection against
the ASGI disconnect message.
"""
import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .engine_loop import EngineLoop
from .metrics import Metrics
from .prompt_logprobs import Prompt
from .protocol import APIError, GenRequest, parse_chat, parse_completion
from .responses import DONE, Body, spec_metrics, sse
from .tokenize import detokenize, tokenize


MAX_BODY_BYTES = 16 * 2**20  # a 131k-token prompt is ~1 MB of JSON


class ServerState:
    """engine: the engine.Engine the server steps (sized by the caller); tokenizer: the target's
    (chat template, text); model_name: the served name; max_model_len: the target's context;
    max_waiting, log_interval: see EngineLoop; max_body_bytes: the request body limit (default
    16 MiB)."""

    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, *,
                 max_waiting: int = 1024, max_body_bytes: int | None = None,
                 log_interval: float = 0.0):
        self.engine, self.tokenizer = engine, tokenizer
        # larger request bodies get 413, unread
        self.max_body_bytes = max_body_bytes or MAX_BODY_BYTES
        self.model_name, self.max_model_len = model_name, max_model_len
        self.metrics = Metrics(model_name, engine.runner.gamma, max_model_len)
        self.loop = EngineLoop(engine, self.metrics, max_waiting=max_waiting,
                               log_interval=log_interval)
        self.created = int(time.time())


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _json(request: Request, limit: int):
    """The body as JSON; APIError 413 once it is larger than limit bytes (told by its
    Content-Length, or counted while reading a chunked one), before it is all in memory."""
    too_large = APIError(413, f"the request body is larger than the server's limit of {limit} "
                         "bytes (--max-body-bytes)")
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise too_large
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # nested deeper than the interpreter's recursion limit
        raise APIError(400, "the request body is not valid JSON here: it nests arrays / objects "
                       "deeper than this server reads") from None


async def _disconnected(request: Request):
    """Returns when the client goes away (the body has been read: the next ASGI message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="dspark_rt", lifespan=lifespan)
    app.state.server = state

    async def api_error(request, e: APIError):
        return _error(e)

    async def http_error(request, e: HTTPException):  # unknown route (404), method (405)
        return _error(APIError(e.status_code, str(e.detail), headers=e.headers))

    async def server_error(request, e: Exception):  # a bug: logged by uvicorn, never shown
        return _error(APIError(500, "internal server error (see the server log)"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)

    @app.get("/health")
    async def health():
        why = state.loop.down()
        if why is not None:
            return _error(APIError(503, f"the engine is down: {why}", type_="service_unavailable"))
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from .. import __version__
        return {"version": __version__}

    def _model(body):
        m = body.get("model") if isinstance(body, dict) else None
        if m is not None and m != state.model_name:
            raise APIError(404, f"The model `{m}` does not exist.", "model")

    @app.post("/tokenize")
    async def tokenize_(request: Request):
        body = await _json(request, state.max_body_bytes)
        _model(body)
        return tokenize(body, state.tokenizer, state.max_model_len)

    @app.post("/detokenize")
    async def detokenize_(request: Request):
        body = await _json(request, state.max_body_bytes)
        _model(body)
        return detokenize(body, state.tokenizer)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "dspark_rt", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        data, ctype = state.metrics.exposition(request.headers.get("accept"))
        return Response(data, media_type=ctype)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request, state.max_body_bytes)
        return await _generate(state, request, parse_completion(body, default_model=state.model_name))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request, state.max_body_bytes)
        g = parse_chat(body, default_model=state.model_name, tokenizer=state.tokenizer,
                       max_model_len=state.max_model_len)
        return await _generate(state, request, g)

    return app


async def _generate(state: ServerState, request: Request, g: GenRequest):
    if g.model != state.model_name:
        raise APIError(404, f"The model `{g.model}` does not exist.", "model")
    try:
        sub = await state.loop.submit(g.prompt, g.params)
    except APIError as e:
        if e.param == "prompt":
            e.param = g.prompt_field
        raise
    body = Body(g.kind, g.model, state.tokenizer, g.logprobs, g.params.stop,
                g.params.skip_special_tokens, include_stop_str=g.include_stop_str,
                usage_every_chunk=g.include_usage and g.continuous_usage,
                prompt_tokens=sub.prompt_tokens, prompt=_prompt(state, g, sub),
                top=g.top_logprobs)
    if g.stream:
        return StreamingResponse(_stream(state, sub, body, g.include_usage),
                                 media_type="text/event-stream")
    collect = asyncio.ensure_future(_collect(state, sub))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():  # the client went away (or this handler was cancelled)
            collect.cancel()    # takes effect at collect's next await: it is not done yet
            state.loop.abort(sub)
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)  # nobody reads it
    ev = collect.result()
    if ev.error is not None or ev.output is None:
        raise _failed(ev)
    return body.full(ev.output)


def _prompt(state: ServerState, g: GenRequest, sub) -> Prompt | None:
    """What the response shows of the prompt (echo, vLLM's prompt_logprobs), or None."""
    if not (g.echo or g.prompt_logprobs is not None):
        return None
    ids = list(sub.req.prompt_ids)
    text = g.prompt if isinstance(g.prompt, str) else (
        state.tokenizer.decode(ids, skip_special_tokens=g.params.skip_special_tokens)
        if state.tokenizer is not None else "")
    return Prompt(text, ids, g.echo, g.top_logprobs, g.prompt_logprobs, g.params.prompt_logprobs,
                  g.score_only)


def _failed(ev) -> APIError:
    """The error of a request the engine failed (500) or could not finish: it is down (503)."""
    return APIError(ev.status, ev.error or "the request was dropped",
                    type_="service_unavailable" if ev.status == 503 else None)


async def _collect(state: ServerState, sub):
    """Waits for the request's last Event."""
    while True:
        ev = await sub.events.get()
        if ev.finished:
            return ev


async def _stream(state: ServerState, sub, body: Body, include_usage: bool):
    done, head = False, body.prompt is not None
    try:
        while True:
            ev = await sub.events.get()
            if head and ev.error is None and (ev.output is not None or not ev.finished):
                # the prompt's chunk first: its log-probabilities came with the first tokens
                yield sse(body.head(ev.output.prompt_logprobs if ev.output is not None
                                    else ev.prompt_logprobs))
                head = False
            if ev.finished:
                done = True
                break
            chunk = body.delta(ev.new_token_ids, ev.logprobs, ev.top_logprobs)
            if chunk is not None:
                yield sse(chunk)
        out = ev.output
        if ev.error is not None or out is None:
            yield sse(_failed(ev).body())
        else:
            last = body.last(ev.new_token_ids, ev.logprobs, out, ev.top_logprobs)
            if include_usage:
                yield sse(last)
                yield sse(body.usage_chunk(out))
            else:  # no usage chunk: the metrics ride on the chunk with the finish reason
                last["metrics"] = spec_metrics(out.metrics)
                yield sse(last)
        yield DONE
    finally:
        if not done:  # the client went away mid-stream: free its pages now
            state.loop.abort(sub)
