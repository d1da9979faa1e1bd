"""A command run as a child process that serves HTTP: started in its own process group, ready
once it answers, stopped with everything it started (rlx's engine servers, SGLang's, sglang-router)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from rlx.ports import PORT_ATTEMPTS

log = logging.getLogger(__name__)


class ChildProcess:
    """A command run in its own process group with output to a log file, plus an HTTP readiness probe.

    `start()` returns once `GET url + health_path` answers 200 (or once `ready(http)` holds, when
    given); if the child exits or the timeout passes first, it is killed and the error shows the
    tail of its output.
    `stop()` sends SIGTERM to the group, then SIGKILL after `grace_s`; nothing is left behind.
    """

    def __init__(
        self,
        cmd: list[str],
        url: str,
        *,
        name: str,
        health_path: str = "/health",
        startup_timeout_s: float = 600.0,
        grace_s: float = 10.0,
        env: dict[str, str] | None = None,
        ready: Callable[[httpx.Client], bool] | None = None,
    ):
        self.cmd = cmd
        self.url = url
        self.name = name
        self.health_path = health_path
        self.ready = ready or (lambda http: http.get(url + health_path).status_code == 200)
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def start(self) -> None:
        fd, log_path = tempfile.mkstemp(prefix=f"rlx-{self.name}-", suffix=".log")
        self.log_path = Path(log_path)
        with os.fdopen(fd, "wb") as log:
            # Own session: stop() can signal the whole group, so no grandchild outlives us.
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(self.env or {})},
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with code {self.proc.returncode} before "
                        f"{self.url}{self.health_path} answered; output tail:\n{self.output_tail()}"
                    )
                try:
                    if self.ready(http):
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name} at {self.url} not healthy after {self.startup_timeout_s:.0f} s; "
                        f"command: {' '.join(self.cmd)}\noutput tail:\n{self.output_tail()}"
                    )
                time.sleep(0.2)

    def output_tail(self, num_chars: int = 4000) -> str:
        """The last characters the child wrote to stdout/stderr."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-num_chars:].decode(errors="replace")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`, reap the child, remove the log."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait_s)
                    # The leader is gone; make sure none of its group survived it.
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
                break
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None


class ChildService:
    """A service run as a `ChildProcess` on `host:port`: start (waits for /health), stop, `with`."""

    host: str
    port: int
    _child: ChildProcess

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self):
        """Start the child and return once its /health answers 200 (else raise with its output).
        A port of its own that another process took between being picked and being bound is
        picked again (`_repick_ports`), up to PORT_ATTEMPTS times."""
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                self._child.start()
                return self
            except RuntimeError as e:
                if "Address already in use" not in str(e) or not self._repick_ports():
                    raise
                log.warning("%s: a port was taken before it bound it; picking new ones", self._child.name)
        self._child.start()  # the last attempt: its error is the caller's
        return self

    def _repick_ports(self) -> bool:
        """Pick the ports this service chose itself again, with a new child for them; False where
        they are the caller's (then a taken port is the caller's error)."""
        return False

    def running(self) -> bool:
        return self._child.running()

    def stop(self) -> None:
        """Terminate (then kill) the child and everything it started; safe to call twice."""
        self._child.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
