"""A live `dspark-rt serve` app for the server tests: uvicorn serving it in a thread of this
process on a free port of 127.0.0.1, the shipped pair it serves, and a check that every page came
back. Import it after pytest.importorskip of fastapi and uvicorn."""
import socket
import threading
import time
from importlib.resources import files

import pytest
import uvicorn

from dspark_rt.server import build_app

PRETRAINED = files("dspark_rt") / "pretrained"
TARGET, DRAFTER = str(PRETRAINED / "target"), str(PRETRAINED / "dspark")
MODEL = "tiny"
PROMPTS = ["def quicksort(xs):", "import os\n\ndef read_lines(path):", "class Stack:\n    def push(self",
           "    for i in range(len(items)):", "# parse the arguments\nimport argparse\n",
           "def __repr__(self):\n        return", "while True:\n    line = f.readline()",
           "from collections import"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """uvicorn serving the app in a thread; stop() shuts it down and joins."""

    def __init__(self, state):
        self.state, self.port = state, _free_port()
        cfg = uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.uv = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.uv.started:
            assert self.thread.is_alive() and time.monotonic() - t0 < 60, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(30)


def _pages_back(state, timeout=30.0):
    """Every page of both caches back in the pool and no request left in the engine."""
    eng, t0 = state.engine, time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not eng.requests and not state.loop._live and all(
                bm.num_used == 0 for bm in (eng.target_blocks, eng.drafter_blocks) if bm):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server():
    """The shipped pair served in float32, 8 requests per batch (a module's fixture: import it)."""
    from dspark_rt.tools.serve import build_state
    srv = _Server(build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=8,
                              dtype="float32"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """The real `openai` client of `server`."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
