"""`dspark-rt serve`'s arguments: each bad one is refused by name at parsing, before any model
is loaded (a port out of range or in use, a queue that would refuse everything, a bad size)."""
import os
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dspark_rt.tools import serve  # noqa: E402
from tests.support.server import DRAFTER, TARGET, _free_port  # noqa: E402


@pytest.fixture
def no_loading(monkeypatch):
    def build_state(*a, **kw):
        raise AssertionError("models loaded before the arguments were checked")
    monkeypatch.setattr(serve, "build_state", build_state)


def _refused(argv, capsys, match):
    with pytest.raises(SystemExit) as e:
        serve.main(["--target", TARGET, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,match", [
    (["--port", "99999"], "argument --port"),
    (["--port", "-1"], "argument --port"),
    (["--port", "http"], "argument --port"),
    (["--max-waiting", "0"], "argument --max-waiting"),
    (["--max-waiting", "-5"], "argument --max-waiting"),
    (["--max-body-bytes", "0"], "argument --max-body-bytes"),
    (["--max-body-bytes", "lots"], "argument --max-body-bytes"),
    (["--log-level", "loud"], "argument --log-level"),
    (["--host", "no such host.invalid", "--port", "8000"], "cannot listen on"),
])
def test_bad_arguments_are_refused_before_loading(argv, match, capsys, no_loading):
    _refused(argv, capsys, match)


def test_port_in_use_is_refused_before_loading(capsys, no_loading):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _refused(["--port", str(port)], capsys, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize("text,want", [("16MiB", 16 * 2**20), ("2GiB", 2 * 2**30),
                                       ("1.5G", 1_500_000_000), ("4096", 4096), ("3 kb", 3000)])
def test_byte_sizes(text, want):
    assert serve.parser().parse_args(["--target", TARGET, "--max-body-bytes", text]
                                     ).max_body_bytes == want


def test_engine_loop_refuses_a_queue_that_takes_nothing():
    from dspark_rt.server.engine_loop import EngineLoop
    with pytest.raises(ValueError, match="max_waiting"):
        EngineLoop(None, max_waiting=0)


# -- the KV pool: sized by a memory budget ----------------------------------------------------

def _sizes(state):
    from dspark_rt.tools.kv_budget import page_bytes
    runner = state.engine.runner
    per_seq = -(-(state.max_model_len + runner.gamma + 2) // runner.page_size)
    return page_bytes(runner), per_seq


def test_default_pool_is_a_fraction_of_available_memory(monkeypatch):
    from dspark_rt.tools import kv_budget
    ref = serve.build_state(TARGET, DRAFTER, max_num_seqs=32, num_pages=1)
    per_page, per_seq = _sizes(ref)
    free = 6 * per_seq * per_page  # half of it (the CPU default) holds three contexts
    monkeypatch.setattr(kv_budget, "available_bytes", lambda device: free)
    state = serve.build_state(TARGET, DRAFTER, max_num_seqs=32)
    assert state.engine.num_pages == int(free * 0.5) // per_page < 32 * per_seq
    state = serve.build_state(TARGET, DRAFTER, max_num_seqs=32, kv_cache_fraction=0.25)
    assert state.engine.num_pages == int(free * 0.25) // per_page
    # plenty of memory: never more than max_num_seqs whole contexts
    monkeypatch.setattr(kv_budget, "available_bytes", lambda device: 2**50)
    assert serve.build_state(TARGET, DRAFTER, max_num_seqs=3).engine.num_pages == 3 * per_seq


def test_kv_cache_memory_and_num_pages(monkeypatch):
    ref = serve.build_state(TARGET, DRAFTER, num_pages=1)
    per_page, per_seq = _sizes(ref)
    state = serve.build_state(TARGET, DRAFTER, kv_cache_memory=2 * per_seq * per_page + 5)
    assert state.engine.num_pages == 2 * per_seq
    assert serve.build_state(TARGET, DRAFTER, num_pages=7).engine.num_pages == 7  # overrides
    with pytest.raises(ValueError, match=r"--kv-cache-memory.*one context of \d+ tokens"):
        serve.build_state(TARGET, DRAFTER, kv_cache_memory=per_seq * per_page - 1)


def test_kv_flags(capsys):
    _refused(["--kv-cache-memory", "1KiB", "--port", str(_free_port())], capsys,
             "one context of")
    _refused(["--num-pages", "5", "--kv-cache-memory", "1GiB"], capsys, "not allowed with")
    _refused(["--kv-cache-fraction", "1.5"], capsys, "argument --kv-cache-fraction")
    _refused(["--kv-cache-fraction", "0"], capsys, "argument --kv-cache-fraction")


def test_a_pool_that_cannot_be_allocated_is_a_clear_error(monkeypatch):
    from dspark_rt.runner.runner import Runner
    allocate = Runner.allocate_caches

    def refuse(self, num_pages):
        if num_pages > 1000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 999999999999 bytes.")
        return allocate(self, num_pages)
    monkeypatch.setattr(Runner, "allocate_caches", refuse)
    with pytest.raises(ValueError, match=r"allocating the KV caches \(5000 pages.*--num-pages"):
        serve.build_state(TARGET, DRAFTER, num_pages=5000)


def test_available_memory_without_psutil(monkeypatch):
    import sys
    from dspark_rt.tools.kv_budget import available_bytes
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil fails: /proc/meminfo
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_bytes("cpu") <= total
