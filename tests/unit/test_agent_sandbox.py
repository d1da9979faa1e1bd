"""The tool sandbox's limits: a tool that sleeps past its time limit is killed, one that allocates
past its memory limit fails, one that opens a socket to a server on loopback fails; each reason
reaches `sample.status_reason` (directly through `call_tool`, and through the tool_calc
generate_fn). Real subprocesses and a real listening socket; CPU, a few seconds."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from rlx.agent import Sandbox, call_tool
from rlx.agent.sandbox import close_sandboxes, namespace_prefix
from rlx.errors import ConfigError
from rlx.sample import Sample, Status

TOOLS = {
    "sleeper.py": "import time\ntime.sleep(60)\nprint('woke')\n",
    "hog.py": "block = bytearray(512 << 20)\nprint(len(block))\n",
    "dialer.py": (
        "import socket, sys\n"
        "socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).sendall(b'hi')\n"
        "print('connected')\n"
    ),
    "adder.py": "import sys\nprint(sum(int(w) for w in sys.stdin.read().split()))\n",
    "crasher.py": "import sys\nsys.exit('bad input: no numbers')\n",
    "napper.py": "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n",
}


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    for name, code in TOOLS.items():
        (root / name).write_text(code)
    return {name: str(root / name) for name in TOOLS}


@pytest.fixture
def listener():
    """A TCP server on loopback that this process can reach: the port."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


def run(sandbox: Sandbox, argv: list[str], stdin: str = "") -> tuple[Sample, float]:
    """`call_tool` on a fresh sample; the sample and the call's wall time."""
    sample = Sample(prompt="", prompt_ids=[1], status=Status.COMPLETED)

    async def go():
        try:
            await call_tool(sandbox, sample, "t", argv, stdin)
        finally:
            await sandbox.aclose()

    start = time.monotonic()
    asyncio.run(go())
    return sample, time.monotonic() - start


def test_a_tool_runs_and_its_output_is_recorded(tools):
    sample, _ = run(Sandbox(time_limit_s=10), [tools["adder.py"]], "40 2")
    assert sample.status is Status.COMPLETED and sample.status_reason == ""
    (call,) = sample.metadata["tool_calls"]
    assert (call["tool"], call["input"], call["output"], call["ok"]) == ("t", "40 2", "42\n", True)


def test_a_tool_that_sleeps_past_its_time_limit_is_killed(tools):
    sample, seconds = run(Sandbox(time_limit_s=0.5), [tools["sleeper.py"]])
    assert sample.status is Status.FAILED
    assert sample.status_reason == "tool t: timed out after 0.5 s (killed)"
    assert 0.5 <= seconds < 5  # killed, not waited for (the tool sleeps 60 s)
    # a shell and its child are killed together (the call's process group)
    sample, seconds = run(Sandbox(time_limit_s=0.5), ["sh", "-c", "sleep 60; echo late"])
    assert sample.status_reason == "tool t: timed out after 0.5 s (killed)" and seconds < 5


def test_a_tool_that_allocates_past_its_memory_limit_fails(tools):
    sample, _ = run(Sandbox(time_limit_s=10, memory_limit_mb=128), [tools["hog.py"]])
    assert sample.status is Status.FAILED
    assert sample.status_reason == "tool t: ran out of memory (memory limit 128 MB): MemoryError"
    # the same allocation under a limit that allows it succeeds: the limit is what stopped it
    sample, _ = run(Sandbox(time_limit_s=10, memory_limit_mb=1024), [tools["hog.py"]])
    assert (
        sample.status is Status.COMPLETED and sample.metadata["tool_calls"][0]["output"] == f"{512 << 20}\n"
    )


def test_a_tool_cannot_reach_a_server_this_process_reaches(tools, listener):
    # control: outside the sandbox the same tool connects
    plain = subprocess.run(
        [sys.executable, tools["dialer.py"], str(listener)], capture_output=True, text=True
    )
    assert plain.stdout == "connected\n", plain.stderr
    sample, _ = run(Sandbox(time_limit_s=10), [tools["dialer.py"], str(listener)])
    assert sample.status is Status.FAILED and sample.status_reason.startswith("tool t: exited with code 1: ")
    if namespace_prefix() is not None:  # a network namespace: nothing is up, not even loopback
        assert sample.status_reason.endswith("OSError: [Errno 101] Network is unreachable")
    else:
        assert "import of socket halted" in sample.status_reason


@pytest.mark.skipif(namespace_prefix() is None, reason="no network namespace can be made here")
def test_a_non_python_tool_is_off_the_network_in_a_namespace(listener):
    probe = f"exec 3<>/dev/tcp/127.0.0.1/{listener} && echo connected"
    assert subprocess.run(["bash", "-c", probe], capture_output=True, text=True).stdout == "connected\n"
    sample, _ = run(Sandbox(time_limit_s=10, network="namespace"), ["bash", "-c", probe])
    assert sample.status is Status.FAILED and "Network is unreachable" in sample.status_reason


def test_the_python_guard_stops_sockets_where_no_namespace_is_made(tools, listener):
    sandbox = Sandbox(time_limit_s=10, network="python")
    assert sandbox.network == "python"
    sample, _ = run(sandbox, [tools["dialer.py"], str(listener)])
    assert sample.status_reason == (
        "tool t: exited with code 1: ModuleNotFoundError: import of socket halted; None in sys.modules"
    )


def test_a_crash_and_too_much_output_are_named(tools):
    sample, _ = run(Sandbox(time_limit_s=10), [tools["crasher.py"]])
    assert sample.status_reason == "tool t: exited with code 1: bad input: no numbers"
    sample, _ = run(Sandbox(time_limit_s=10, max_output_bytes=100), ["sh", "-c", "yes"])
    assert sample.status_reason == "tool t: wrote more than 100 bytes to stdout (killed)"
    assert len(sample.metadata["tool_calls"][0]["output"]) == 100


def test_a_python_tool_runs_as_main_and_an_edit_or_a_syntax_error_shows_on_the_next_call(tmp_path):
    """The fork server compiles a Python tool once and runs its code as `__main__` (as run_path
    would); it compiles again when the file's bytes change, even to the same size within the same
    clock tick, and a file that does not compile fails the call naming the error."""
    tool = tmp_path / "who.py"
    script = '"""doc"""\nimport sys\nprint(__name__, __doc__, __file__ == sys.argv[0], sys.argv[1:], "v{}")\n'
    sandbox = Sandbox(time_limit_s=10, max_concurrency=1)  # one fork server: its cache is what runs

    async def calls():
        outputs = []
        try:
            for code in [script.format(1), script.format(2), "print(1 +\n"]:
                tool.write_text(code)
                result = await sandbox.run([str(tool), "x"])
                outputs.append(result.output.strip() if result.ok else result.reason)
        finally:
            await sandbox.aclose()
        return outputs

    first, second, broken = asyncio.run(calls())
    assert first == "__main__ doc True ['x'] v1"
    assert second == "__main__ doc True ['x'] v2"
    assert broken.startswith("exited with code 1: SyntaxError"), broken


def test_bad_limits_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="time limit must be > 0"):
        Sandbox(time_limit_s=0)
    with pytest.raises(ConfigError, match="not one of"):
        Sandbox(network="off")


def test_the_tool_calc_generate_fn_surfaces_a_sandbox_failure(tools, monkeypatch):
    from test_agent_turns import (  # tests/unit is on sys.path
        CALL,
        ScriptedEngine,
        context,
        prompt,
        run_on_a_loop,
    )
    from transformers import PreTrainedTokenizerFast

    from examples.tool_calc import generate as tool_calc
    from rlx.models.tiny import write_word_tokenizer

    path = tools["sleeper.py"].rsplit("/", 1)[0]
    write_word_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    monkeypatch.setattr(tool_calc, "CALCULATOR", tools["sleeper.py"])
    monkeypatch.setattr(tool_calc, "SANDBOX", Sandbox(time_limit_s=0.5))
    engine = ScriptedEngine(([CALL], [-0.5], "stop"))
    s = prompt(tokenizer)
    run_on_a_loop(tool_calc.generate(context(tokenizer, engine), s, {"max_new_tokens": 15}))
    assert s.status is Status.FAILED and s.status_reason == "tool calculator: timed out after 0.5 s (killed)"
    assert s.response_ids == [CALL] and len(engine.requests) == 1  # nothing after the failed call


def test_close_sandboxes_stops_every_sandboxs_servers_of_the_loop_before_it_closes(tools):
    """A loop in a thread of its own, as the rollout pool's: servers left open when it closes are
    closed by the garbage collector later, which Python 3.12 reports at exit ("Event loop is
    closed", once a server; seen at the end of a tool_calc_gpu run). After `close_sandboxes`, run
    on the loop, each server has exited and its stdin pipe is closing: nothing left to collect."""
    sandboxes = [Sandbox(max_concurrency=2), Sandbox(max_concurrency=1)]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    on_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    try:

        async def calls():
            return await asyncio.gather(*(sb.run([tools["adder.py"]], "1 2") for sb in sandboxes * 2))

        results = on_loop(calls())
        assert [r.output for r in results] == ["3\n"] * 4
        servers = [server for sb in sandboxes for server in sb._pools[loop].servers]
        assert len(servers) == 3 and all(s.returncode is None for s in servers)  # 2 + 1, alive
        on_loop(close_sandboxes())
        assert all(s.returncode == 0 and s.stdin.is_closing() for s in servers)
        assert all(loop not in sb._pools for sb in sandboxes)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


async def tool_started(pidfile: Path) -> int:
    """The napper tool's pid, once it has written it."""
    while not (pidfile.exists() and pidfile.read_text()):
        await asyncio.sleep(0.02)
    return int(pidfile.read_text())


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def test_a_call_given_up_mid_tool_takes_its_tool_with_its_fork_server(tools, tmp_path):
    """A call whose task is cancelled (a rollout's aborted group) discards its fork server; the
    tool it was running (its own session) is killed with it, not left sleeping for its 60 s."""
    pidfile, sandbox = tmp_path / "pid", Sandbox(time_limit_s=30)

    async def go() -> int:
        call = asyncio.create_task(sandbox.run([tools["napper.py"], str(pidfile)]))
        pid = await tool_started(pidfile)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await sandbox.aclose()
        return pid

    pid = asyncio.run(go())
    assert gone_within(pid, 2.0)


def test_closing_a_sandbox_mid_call_ends_within_its_grace_and_kills_the_tool(tools, tmp_path):
    """`close_sandboxes` at a run's end with a call still running (a tool with a long time limit):
    the busy server gets STOP_GRACE_S to finish, then is stopped with its tool; the call fails."""
    from rlx.agent.sandbox import STOP_GRACE_S

    pidfile, sandbox = tmp_path / "pid", Sandbox(time_limit_s=30)

    async def go() -> tuple[int, float]:
        call = asyncio.create_task(sandbox.run([tools["napper.py"], str(pidfile)]))
        pid = await tool_started(pidfile)
        start = time.monotonic()
        await close_sandboxes()
        with pytest.raises(RuntimeError, match="the sandbox's fork server failed"):
            await call
        return pid, time.monotonic() - start

    pid, seconds = asyncio.run(go())
    assert seconds < 2 * STOP_GRACE_S + 1 and gone_within(pid, 2.0)
