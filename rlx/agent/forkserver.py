"""The sandbox's fork server: forks one child per tool call, with the limits set in the child.

Run by `rlx.agent.sandbox.Sandbox` as `python -I -S forkserver.py BLOCK` (inside `unshare -n`
where a network namespace can be made), so it imports only the standard library. It reads one
JSON request a line on stdin ({argv, stdin, env, memory_bytes, cpu_s, time_limit_s,
max_output_bytes}) and writes one JSON reply a line on stdout ({rc, out, err, timed_out,
too_long, seconds}); one call at a time. Forking this small, single-threaded process costs about
a millisecond, where starting an interpreter per call costs ten or more. A Python tool is compiled
here once (again when its file's bytes change) and its code run in the child as `__main__`, as
`runpy.run_path` would: run_path in the fresh child, importing and compiling there, took 18 ms a
call on a 2-core VM (copy-on-write faults), the precompiled code 0.2 ms.
"""

import io
import json
import os
import resource
import runpy
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types

BLOCK_SOCKETS = len(sys.argv) > 1 and sys.argv[1] == "1"
CHUNK = 65536
_compiled: dict[str, tuple[bytes, types.CodeType | None]] = {}  # path -> (source, its code)
_running: tuple[int, str] | None = None  # the tool call's child and its working directory, while one runs


def kill_group(pid: int) -> None:
    """SIGKILL a tool call's child and its process group (its own session: whatever it started)."""
    for kill in (os.killpg, os.kill):  # the group, and the child should it not have made one yet
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop(signum: int, frame) -> None:
    """SIGTERM: the sandbox discards this server (a call it stopped waiting for, or its loop
    closing). The running tool goes with it, not left behind (its session outlives the server)."""
    if _running is not None:
        kill_group(_running[0])
        shutil.rmtree(_running[1], ignore_errors=True)
    os._exit(128 + signum)


def compiled(path: str) -> types.CodeType | None:
    """The tool file's code, compiled again only when the file's bytes change (read every call: a
    few microseconds); None where it cannot be read or compiled (the child's run_path then reports
    why, as the tool's failure), or for a relative path (the child resolves it in its directory)."""
    if not os.path.isabs(path):
        return None
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError:
        return None
    cached = _compiled.get(path)
    if cached is None or cached[0] != source:
        try:
            code = compile(source, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            code = None
        cached = _compiled[path] = (source, code)
    return cached[1]


def run_main(path: str, code: types.CodeType | None) -> None:
    """Run the tool's code as the `__main__` module, with what `runpy.run_path` gives a script."""
    if code is None:
        runpy.run_path(path, run_name="__main__")
        return
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def run_child(
    request: dict, fds: tuple[int, int, int], workdir: str, program: types.CodeType | None = None
) -> None:
    """In the forked child: its own session, the limits, then the tool (`program`: a Python
    tool's code, compiled by the server). Never returns."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.chdir(workdir)
        limit = request["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CPU, (request["cpu_s"], request["cpu_s"]))
        argv, env = request["argv"], request["env"]
        if not argv[0].endswith(".py"):
            os.execvpe(argv[0], argv, env)
        os.environ.clear()
        os.environ.update(env)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        if BLOCK_SOCKETS:
            sys.modules["socket"] = sys.modules["_socket"] = None  # import socket -> ImportError
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        try:
            run_main(argv[0], program)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        sys.stdout.flush()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def run_call(request: dict) -> dict:
    """One tool call: fork, feed stdin, collect stdout/stderr until both close or the deadline."""
    workdir = tempfile.mkdtemp(prefix="rlx-tool-")
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    argv = request["argv"]
    program = compiled(argv[0]) if argv[0].endswith(".py") else None
    start = time.monotonic()
    global _running
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no stop() before _running is set
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        run_child(request, (in_r, out_w, err_w), workdir, program)
    _running = (pid, workdir)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    data = request["stdin"].encode()
    os.set_blocking(in_w, False)
    writing = in_w
    if not data:
        os.close(in_w)
        writing = None
    out, err, reading = bytearray(), bytearray(), {out_r: "out", err_r: "err"}
    deadline = start + request["time_limit_s"]
    timed_out = too_long = False
    while reading or writing is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        readable, writable, _ = select.select(list(reading), [] if writing is None else [writing], [], left)
        if writable:
            try:
                data = data[os.write(writing, data[:CHUNK]) :]
            except BrokenPipeError:  # the tool did not read it all
                data = b""
            if not data:
                os.close(writing)
                writing = None
        for fd in readable:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                del reading[fd]
                os.close(fd)
            elif reading[fd] == "out":
                out += chunk
                too_long = len(out) > request["max_output_bytes"]
            else:
                err = (err + chunk)[-8192:]  # its tail is enough for a reason
        if too_long:
            break
    if timed_out or too_long:
        kill_group(pid)
    _, status = os.waitpid(pid, 0)
    _running = None
    for fd in [*reading, *([] if writing is None else [writing])]:
        os.close(fd)
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "rc": os.waitstatus_to_exitcode(status),
        "out": bytes(out[: request["max_output_bytes"]]).decode(errors="replace"),
        "err": bytes(err).decode(errors="replace"),
        "timed_out": timed_out,
        "too_long": too_long,
        "seconds": time.monotonic() - start,
    }


def serve() -> None:
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(0, CHUNK)
            if not chunk:  # the sandbox closed our stdin: done
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        reply = memoryview(json.dumps(run_call(json.loads(line))).encode() + b"\n")
        while reply:
            reply = reply[os.write(1, reply) :]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run, which closes our stdin
    signal.signal(signal.SIGTERM, stop)
    serve()
