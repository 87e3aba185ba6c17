"""One Engine, one background thread stepping it; HTTP requests arrive on an asyncio loop.

The engine thread owns the Engine: it alone makes, adds and aborts requests and steps, so an
add or abort never waits on a step behind the Engine's lock while holding up the event loop.
The event loop posts work into an inbox (submit, abort) and reads each request's results from
its own asyncio.Queue, filled by the engine thread with loop.call_soon_threadsafe.

A request leaves exactly once: finished by the engine (its last Event carries the
RequestOutput), aborted (a client that went away: its pages go back to the pool at once) or
failed (the engine raised; every request in flight gets the error, the loop goes on). When the
engine can run nothing more (a tensor-parallel worker died, or the engine thread itself), the
loop is down: every request in flight or queued gets 503 with the reason, and so does every
later one; down() is what /health reports.
"""
import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from ..parallel.runner import WorkerError
from ..sampling_params import SamplingParams
from .errors import APIError
from .stats import RequestTimes, StepStats, _Seen

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What a request got from one step: new tokens (and their log-probabilities when asked);
    on the last one, finished and the RequestOutput (or error)."""
    new_token_ids: list[int]
    logprobs: list[float] | None
    finished: bool = False
    output: object = None   # outputs.RequestOutput
    error: str | None = None
    status: int = 500       # the HTTP status of an error
    prompt_logprobs: list | None = None  # on a request's first Event, when it asked for them
    top_logprobs: list | None = None  # per new token its row's top N ((id, logprob), ...)


@dataclass(eq=False)
class Submission:
    """One HTTP request's handle on the engine. request_id and prompt_tokens are set by the
    engine thread when the request is queued; then `started` resolves."""
    prompt: object
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    started: asyncio.Future
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    seen: _Seen = field(default_factory=_Seen)  # speculative metrics already counted
    request_id: int | None = None
    prompt_tokens: int = 0
    req: object = None       # engine.request.Request
    sent_logprobs: int = 0   # log-probabilities already handed out
    sent_events: int = 0     # Events handed out
    cancelled: bool = False  # the client went away before the request was queued


def _post(loop, fn, *args):
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: the server is shutting down
        pass


def _resolve(fut: asyncio.Future, value):
    if not fut.done():
        (fut.set_exception if isinstance(value, BaseException) else fut.set_result)(value)


class EngineLoop:
    """engine: an engine.Engine; metrics: a server.metrics.Metrics (or None); max_waiting:
    requests that may wait for a batch slot (queued or not yet added) before new ones get 503;
    log_interval: seconds between stats lines in the log (0: none)."""

    def __init__(self, engine, metrics=None, *, max_waiting: int = 1024, log_interval: float = 0.0):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an int >= 1 (0 would refuse every request), "
                             f"got {max_waiting!r}")
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.stats = StepStats(engine, metrics, log_interval)
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Submission]] = []
        self._live: dict[int, Submission] = {}  # request id -> submission, until it leaves
        self._stopping = False
        self._dead: str | None = None  # why the engine can run nothing more
        self._thread = threading.Thread(target=self._run, name="dspark-rt-engine", daemon=True)
        self.num_steps = 0

    # -- event-loop side ---------------------------------------------------------------------

    def start(self):
        self._thread.start()

    def stop(self, timeout: float = 10.0):
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def down(self) -> str | None:
        """Why the engine can serve nothing more, or None while it can: the engine thread
        stopped, or a tensor-parallel worker exited (seen here even while the engine idles)."""
        if self._dead is not None:
            return self._dead
        if not self._thread.is_alive():
            return "the engine thread is not running"
        tp = getattr(self.engine.runner, "tensor_parallel", None)  # the leader's group
        if tp is not None:
            for rank, p in enumerate(tp.procs, 1):
                if p.poll() is not None:
                    return (f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code "
                            f"{p.returncode}")
            if tp.closed:
                return "the tensor-parallel group is shut down"
        return None

    async def submit(self, prompt, params: SamplingParams) -> Submission:
        """Queues a request; returns once it is in the engine. Its grammar, if any, is compiled
        first in a worker thread (xgrammar releases the GIL): the engine thread only looks it up.
        Raises APIError 400 for a prompt
        the engine refuses (too long, bad token ids), 503 when the queue is full or the engine
        is down."""
        loop = asyncio.get_running_loop()
        if params.structured_outputs is not None:  # compiled here, so rounds never wait on it
            try:
                await asyncio.to_thread(self.engine.compile_grammar, params.structured_outputs)
            except ValueError as e:
                raise APIError(400, str(e), "structured_outputs") from None
        sub = Submission(prompt, params, loop, loop.create_future())
        with self._cv:
            why = self.down()  # under the lock: a dying engine thread answers what is queued
            if why is not None:
                raise APIError(503, f"the engine is down: {why}", type_="service_unavailable")
            pending = sum(1 for kind, _ in self._inbox if kind == "add")
            if pending + self.engine.num_waiting >= self.max_waiting:
                raise APIError(503, f"the server is busy: {self.max_waiting} requests are already "
                               "waiting; retry later", headers={"Retry-After": "1"})
            self._inbox.append(("add", sub))
            self._cv.notify()
        try:
            await asyncio.shield(sub.started)
        except asyncio.CancelledError:
            self.abort(sub)
            raise
        return sub

    def abort(self, sub: Submission):
        """Drops the request wherever it is (no-op once it left)."""
        with self._cv:
            sub.cancelled = True
            self._inbox.append(("abort", sub))
            self._cv.notify()

    # -- engine thread -----------------------------------------------------------------------

    def _run(self):
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - a thread that dies must say so, not hang
            log.exception("the engine thread stopped")
            self._die(f"the engine thread stopped ({type(e).__name__})")

    def _serve(self):
        eng = self.engine
        while True:
            with self._cv:
                while not (self._inbox or self._stopping or eng.has_unfinished()):
                    # woken for the stats line too, which reports an interval's end when idle
                    self._cv.wait(self.stats.log_interval or None)
                    self.stats.maybe_log()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            for kind, sub in inbox:
                (self._add if kind == "add" else self._abort)(sub)
            if eng.has_unfinished():
                t0 = time.monotonic()
                try:
                    outs = eng.step()
                except WorkerError as e:  # the tensor-parallel group is gone
                    log.error("the engine is down: %s", e)
                    return self._die(str(e))
                except Exception as e:  # an engine bug: fail what is in flight, keep serving
                    log.exception("Engine.step failed")
                    self._fail_all(f"engine failure ({type(e).__name__}; see the server log)")
                    continue
                self.num_steps += 1
                self.stats.stepped(self._live, outs, t0, time.monotonic())
                for o in outs:
                    sub = self._live.get(o.request_id)
                    if sub is not None:
                        self._deliver(sub, o.new_token_ids, o.finished, o.output, o.error)
            self.stats.state()
            self.stats.maybe_log()
        for sub in list(self._live.values()):  # shutting down: nothing stays in flight
            self._abort(sub)

    def _add(self, sub: Submission):
        if sub.cancelled:  # nobody waits for it
            return
        try:
            req = self.engine.make_request(sub.prompt, sub.params)
            self.engine.add(req)
        except ValueError as e:  # the prompt does not fit the model (length, token ids)
            msg = str(e).removeprefix("request 0: ").replace("SamplingParams.", "")
            param = next((f for f in ("stop_token_ids", "stop", "allowed_token_ids", "bad_words")
                          if msg.startswith(f)), "prompt")
            return _post(sub.loop, _resolve, sub.started, APIError(400, msg, param))
        except Exception as e:  # noqa: BLE001 - a bug must not take the engine thread down
            log.exception("adding a request failed")
            return _post(sub.loop, _resolve, sub.started,
                         APIError(500, f"adding the request failed ({type(e).__name__}; see the "
                                  "server log)"))
        sub.req, sub.request_id, sub.prompt_tokens = req, req.request_id, len(req.prompt_ids)
        self._live[req.request_id] = sub
        _post(sub.loop, _resolve, sub.started, sub)

    def _abort(self, sub: Submission):
        if sub.request_id is None or self._live.pop(sub.request_id, None) is None:
            return
        if self.engine.abort(sub.request_id):  # its pages are back in the pool
            out = self.engine.output(sub.req)
            self._finished(sub, out)
            _post(sub.loop, sub.events.put_nowait, Event([], None, True, out))

    def _deliver(self, sub: Submission, new_ids, finished, output=None, error=None):
        lps = tops = None
        if sub.params.num_logprobs is not None:
            got = slice(sub.sent_logprobs, sub.sent_logprobs + len(new_ids))
            lps, tops = list(sub.req.logprobs[got]), list(sub.req.top_logprobs[got])
            sub.sent_logprobs += len(new_ids)
        prompt_lps = None
        if not sub.sent_events and sub.params.prompt_logprobs is not None:
            prompt_lps = sub.req.prompt_logprobs  # complete once the prefill emitted a token
        sub.sent_events += 1
        if finished:
            del self._live[sub.request_id]
            if output is not None:
                self._finished(sub, output)  # counters first: a client that sees its
                # response and then reads /metrics finds its request counted
        _post(sub.loop, sub.events.put_nowait, Event(list(new_ids), lps, finished, output, error,
                                                     prompt_logprobs=prompt_lps,
                                                     top_logprobs=tops))

    def _finished(self, sub: Submission, out):
        sub.times.left = time.monotonic()
        if self.metrics is not None:
            self.metrics.finished(out, sub.times, sub.params.max_tokens)

    def _fail_all(self, why: str, status: int = 500):
        for sub in list(self._live.values()):
            try:
                if self.engine.abort(sub.request_id):
                    self._finished(sub, self.engine.output(sub.req))
            except Exception:  # noqa: BLE001 - a broken engine: the request leaves regardless
                log.exception("aborting request %s failed", sub.request_id)
            self._live.pop(sub.request_id, None)
            _post(sub.loop, sub.events.put_nowait, Event([], None, True, None, why, status))

    def _die(self, why: str):
        """The engine can run nothing more: what is queued or in flight gets 503, and so does
        every later request (submit reads _dead under the same lock)."""
        with self._cv:
            self._dead = why
            inbox, self._inbox = self._inbox, []
        err = f"the engine is down: {why}"
        for kind, sub in inbox:
            if kind == "add":
                _post(sub.loop, _resolve, sub.started,
                      APIError(503, err, type_="service_unavailable"))
        self._fail_all(err, 503)
