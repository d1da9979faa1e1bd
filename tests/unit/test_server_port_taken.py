"""A server child whose port another process took between its pick and its bind (the child exits:
"Address already in use", as a CI run's engine server once did beside the suite's other workers)
is started again on a new port when the port was its own pick (`ChildService.start`), and fails
naming the cause when the caller gave the port."""

from __future__ import annotations

import socket

import httpx
import pytest

from rlx.rollout import sglang
from rlx.rollout.sglang import ServerProcess

# a stand-in for a server module: sglang.launch_server's --host and --port, /health answers 200
HEALTH_SERVER = """
import argparse
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
HTTPServer((args.host, args.port), Health).serve_forever()
"""


@pytest.fixture
def taken_port():
    """A port another socket holds for the test's length (bound, not listening: a probe of it is
    refused at once, where a listener that never answers would hold the probe to its timeout)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def server(tmp_path, port: int | None = None) -> ServerProcess:
    (tmp_path / "health_server.py").write_text(HEALTH_SERVER)
    env = {"PYTHONPATH": str(tmp_path)}
    return ServerProcess("unused", port, module="health_server", env=env, startup_timeout_s=30)


def test_its_own_port_taken_before_it_bound_is_picked_again(tmp_path, taken_port, monkeypatch):
    picks = iter([taken_port])  # the first pick: a port another process takes meanwhile
    real = sglang.free_port
    monkeypatch.setattr(sglang, "free_port", lambda host: next(picks, None) or real(host))
    process = server(tmp_path)
    assert process.port == taken_port
    with process:
        assert process.port != taken_port
        assert httpx.get(f"{process.url}/health").status_code == 200


def test_a_port_the_caller_gave_is_not_changed(tmp_path, taken_port):
    process = server(tmp_path, port=taken_port)
    with pytest.raises(RuntimeError, match="Address already in use"):
        process.start()
    assert process.port == taken_port
    assert not process.running()
