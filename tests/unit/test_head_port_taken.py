"""A SLURM job's Ray head (`rlx.launcher.nodes.start_head`) whose port another process took between
its pick and Ray's bind: `ray start --head` fails naming the port (Ray 2.60's message below, about
40 s after its start), and the head starts again on a new port, up to PORT_ATTEMPTS times; a head
that fails for another reason is not started again. `ray start` and the join are stand-ins here
(a real failing start takes 40 s); tests/integration/test_slurm.py starts real heads."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from rlx.launcher import nodes, ray_start
from rlx.ports import PORT_ATTEMPTS

# what `ray start --head --port=PORT --block` printed here with PORT held by another process
# (Ray 2.60.0, 2026-12-01), its last line but one
RAY_PORT_TAKEN = (
    "RuntimeError: Failed to start GCS.  Last 1 lines of error files:\n"
    "[2026-12-01 02:59:44,204 C 5866 5866] (gcs_server) grpc_server.cc:134:  An unexpected system state "
    "has occurred. Check failed: server_ Failed to start the grpc server. The specified port is {port}. "
    "This means that Ray's core components will not be able to function correctly. If the server startup "
    "error message is `Address already in use`, it indicates the server fails to start because the port "
    "is already used by other processes\n"
)


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """`ray start` as a child that prints `fail[port]` into the log and exits 1 where the port maps
    to a message, else stays up; the join answers only a head that stayed up. Yields the ports each
    start was given and the children."""
    failures: dict[int, str] = {}
    started: list[tuple[int, subprocess.Popen]] = []

    def fake_ray_start(role, args, log_path, token):
        port = int(next(a for a in args if a.startswith("--port=")).split("=")[1])
        if port in failures:
            code = f"open({str(log_path)!r}, 'a').write({failures[port]!r}); raise SystemExit(1)"
        else:
            code = "import time; time.sleep(60)"
        proc = subprocess.Popen([sys.executable, "-c", code])
        started.append((port, proc))
        return proc

    def fake_join(address):
        port = int(address.rsplit(":", 1)[1])
        if port in failures or not any(p == port and proc.poll() is None for p, proc in started):
            raise ConnectionError(address)

    monkeypatch.setattr(nodes, "_ray_start", fake_ray_start)
    monkeypatch.setattr(ray_start, "join", fake_join)
    monkeypatch.setattr(nodes, "POLL_S", 0.05)
    yield failures, started
    for _, proc in started:
        nodes.stop(proc)


def picks(monkeypatch, ports: list[int]) -> None:
    queue = iter(ports)
    monkeypatch.setattr(nodes, "free_port", lambda host: next(queue))


ROLE = nodes.NodeRole("head", 0, ("localhost",), "4343")


def test_a_taken_port_is_picked_again(stand_ins, monkeypatch, tmp_path, caplog):
    failures, started = stand_ins
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        failures[taken] = RAY_PORT_TAKEN.format(port=taken)
        picks(monkeypatch, [taken, taken + 1])
        address, proc = nodes._start_head_ray(ROLE, "127.0.0.1", tmp_path / "ray.log", "token", 30)
    assert address == f"127.0.0.1:{taken + 1}" and proc.poll() is None
    assert [port for port, _ in started] == [taken, taken + 1]
    assert started[0][1].returncode == 1
    assert f"port {taken} was taken before Ray bound it" in caplog.text


def test_every_pick_taken_fails_after_port_attempts(stand_ins, monkeypatch, tmp_path):
    failures, started = stand_ins
    ports = [41001, 41002, 41003, 41004]
    failures.update({port: RAY_PORT_TAKEN.format(port=port) for port in ports})
    picks(monkeypatch, ports)
    with pytest.raises(nodes.HeadPortTaken, match="port 41003 was taken before Ray bound it"):
        nodes._start_head_ray(ROLE, "127.0.0.1", tmp_path / "ray.log", "token", 30)
    assert [port for port, _ in started] == ports[:PORT_ATTEMPTS]


def test_another_failure_or_another_ports_message_is_not_retried(stand_ins, monkeypatch, tmp_path):
    """Only the message naming this start's own port counts, and only what this start logged: an
    earlier start's lines about its port in the same log do not."""
    failures, started = stand_ins
    log_path = tmp_path / "ray.log"
    log_path.write_text(RAY_PORT_TAKEN.format(port=41011))  # an earlier start's, same log
    failures[41011] = "ValueError: some other failure\n"
    failures[41012] = RAY_PORT_TAKEN.format(port=41099)
    for port in (41011, 41012):
        picks(monkeypatch, [port, 41020])
        with pytest.raises(nodes.NodeJoinError, match="exited with code 1") as raised:
            nodes._start_head_ray(ROLE, "127.0.0.1", log_path, "token", 30)
        assert not isinstance(raised.value, nodes.HeadPortTaken)
    assert [port for port, _ in started] == [41011, 41012]
