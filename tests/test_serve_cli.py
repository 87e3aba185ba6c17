"""`dspark-rt serve`'s arguments: each bad one is refused by name at parsing, before any model
is loaded (a port out of range or in use, a queue that would refuse everything, a bad size)."""
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dspark_rt.tools import serve  # noqa: E402
from tests.test_server import TARGET  # noqa: E402


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
