"""rlx's one boundary module for SGLang: its command line and its /generate JSON.

Servers (SGLang's, or rlx's own, which takes the same flags) start as child processes; engine
args from the config (`rollout.engine_args`) become `--flags` unchanged, so rlx never mirrors
SGLang's option list, and `module="rlx.rollout.http_server"` starts rlx's local engine through
the identical path. A child's API key (SGLang's and sglang-router's `--api-key`) travels in its
environment, never on its command line (`rlx.rollout.keyed_launch`). `parse_generate` / `build_response` are SGLang's GenerateReqInput and its
response as sglang 0.5.4 shapes them (`sglang/srt/managers/io_struct.py`,
`tokenizer_manager.py::_handle_batch_output`, `detokenizer_manager.py::trim_matched_stop`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from rlx.ports import API_KEY_ENV, free_port
from rlx.rollout.local import GenerateOutput, GenerateRequest, LocalEngine, SamplingParams


def cli_flags(args: dict[str, Any] | None) -> list[str]:
    """{"mem_fraction_static": 0.8, "enable_x": True, "urls": [a, b]} -> --mem-fraction-static 0.8 ...

    True is a bare flag, False and None are left out, a list is the flag followed by its items. A
    value that starts with "-" (an API key from `secrets.token_urlsafe`, a negative number) is joined
    to its flag, `--api-key=-x`: apart, argparse would read it as the next flag.
    """
    flags: list[str] = []
    for key, value in (args or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        elif str(value).startswith("-"):
            flags.append(f"{flag}={value}")
        else:
            flags += [flag, str(value)]
    return flags


def module_cmd(module: str, flags: list[str], *, keyed: bool = False) -> list[str]:
    """`python -m module flags...`; `keyed`: through `rlx.rollout.keyed_launch`, which adds
    `--api-key` from the child's environment (`key_env`)."""
    return [sys.executable, "-m", *(["rlx.rollout.keyed_launch"] if keyed else []), module, *flags]


def key_env(api_key: str | None) -> dict[str, str]:
    """The environment that hands `api_key` to a `keyed` child ({} without a key)."""
    return {API_KEY_ENV: api_key} if api_key else {}


def launch_server_cmd(
    model_path: str,
    port: int,
    engine_args: dict[str, Any] | None,
    module: str = "sglang.launch_server",
    host: str = "127.0.0.1",
    *,
    keyed: bool = False,
) -> list[str]:
    """The command line that starts `module` (sglang.launch_server's flags) serving `model_path`;
    `keyed`: see `module_cmd`."""
    args = {"host": host, **(engine_args or {})}
    args.pop("model_path", None)
    args.pop("port", None)
    flags = ["--model-path", str(model_path), "--port", str(port), *cli_flags(args)]
    return module_cmd(module, flags, keyed=keyed)


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
        """Start the child and return once its /health answers 200 (else raise with its output)."""
        self._child.start()
        return self

    def running(self) -> bool:
        return self._child.running()

    def stop(self) -> None:
        """Terminate (then kill) the child and everything it started; safe to call twice."""
        self._child.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class ServerProcess(ChildService):
    """An SGLang-API server child process (`sglang.launch_server` or `rlx.rollout.http_server`);
    with `api_key`, it requires `Authorization: Bearer api_key` on every route but /health."""

    def __init__(
        self,
        model_path: str,
        port: int | None = None,
        engine_args: dict[str, Any] | None = None,
        *,
        module: str = "sglang.launch_server",
        host: str = "127.0.0.1",
        startup_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ):
        self.host = host
        self.port = port or free_port(host)
        cmd = launch_server_cmd(
            model_path, self.port, engine_args, module=module, host=host, keyed=bool(api_key)
        )
        self._child = ChildProcess(
            cmd, self.url, name=module.replace(".", "-"), startup_timeout_s=startup_timeout_s,
            env={**(env or {}), **key_env(api_key)},
        )  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child.proc else None


# SGLang sampling keys the local engine honours only at their default (no-op) values.
_NOOP_SAMPLING = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
}
_IGNORED_SAMPLING = {"spaces_between_special_tokens", "custom_params", "stream_interval"}


def parse_sampling_params(params: dict[str, Any] | None) -> SamplingParams:
    """SGLang's `sampling_params` JSON -> SamplingParams; ValueError for what the local engine can't honour."""
    params = dict(params or {})
    for key, default in _NOOP_SAMPLING.items():
        if params.pop(key, default) not in (default, None):
            raise ValueError(f"sampling param {key!r} is not supported by the local engine")
    for key in _IGNORED_SAMPLING:
        params.pop(key, None)
    unknown = set(params) - set(SamplingParams.__slots__)
    if unknown:
        raise ValueError(f"unknown sampling params: {sorted(unknown)}")
    params = {k: v for k, v in params.items() if v is not None}
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    sampling = SamplingParams(**params)
    sampling.verify()
    return sampling


def _per_item(value: Any, num: int, name: str, is_list=lambda v: isinstance(v, list)) -> list[Any]:
    """SGLang's batch normalisation: one value for all items, or one per item."""
    if is_list(value):
        if len(value) != num:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {num}")
        return list(value)
    return [value] * num


def parse_generate(body: dict[str, Any], engine: LocalEngine) -> tuple[list[dict[str, Any]], bool]:
    """SGLang's GenerateReqInput (single or batch) -> one dict per prompt, and whether it was single."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("Either text or input_ids should be provided.")
    if text is not None:
        single = isinstance(text, str)
        prompts = [engine.tokenizer.encode(t) for t in ([text] if single else text)]
    else:
        single = not input_ids or not isinstance(input_ids[0], list)
        prompts = [input_ids] if single else input_ids
    num = len(prompts)
    rids = body.get("rid")
    if rids is None:
        rids = uuid.uuid4().hex if single else [uuid.uuid4().hex for _ in range(num)]
    elif single != isinstance(rids, str):
        raise ValueError("The rid should be a string for a single request and a list for a batch.")
    items = []
    for prompt, rid, sampling, logprob, start, top, ids_logprob in zip(
        prompts,
        [rids] if single else rids,
        _per_item(body.get("sampling_params"), num, "sampling_params"),
        _per_item(body.get("return_logprob") or False, num, "return_logprob"),
        _per_item(body.get("logprob_start_len", -1), num, "logprob_start_len"),
        _per_item(body.get("top_logprobs_num") or 0, num, "top_logprobs_num"),
        _per_item(
            body.get("token_ids_logprob"),
            num,
            "token_ids_logprob",
            lambda v: isinstance(v, list) and bool(v) and isinstance(v[0], list),
        ),
        strict=True,
    ):
        if top or ids_logprob:
            raise ValueError("top_logprobs_num and token_ids_logprob are not supported by the local engine")
        request = GenerateRequest(
            list(prompt), parse_sampling_params(sampling), str(rid), -1 if start is None else int(start)
        )
        engine.validate(request)
        _check_context(request, (sampling or {}).get("max_new_tokens"), engine)
        items.append({"request": request, "return_logprob": bool(logprob)})
    return items, single


def _check_context(request: GenerateRequest, max_new_tokens: int | None, engine: LocalEngine) -> None:
    """SGLang's tokenizer manager: a `max_new_tokens` the caller asked for that, with the input,
    reaches the context length is the request's error, unless the server allows auto truncation
    (`allow_auto_truncate`, SGLang's flag); the engine itself caps generation at the context."""
    if max_new_tokens is None or engine.args.allow_auto_truncate:
        return
    num_input, context = len(request.input_ids), engine.context_length
    if num_input + int(max_new_tokens) >= context:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. "
            f"You requested a total of {num_input + int(max_new_tokens)} tokens: {num_input} tokens from "
            f"the input messages and {max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )


def build_response(
    engine: LocalEngine,
    item: dict[str, Any],
    output: GenerateOutput,
    weight_version: str,
    e2e_latency: float,
    text_in_logprobs: bool,
) -> dict[str, Any]:
    """One result exactly as SGLang's tokenizer manager shapes it (`_handle_batch_output`)."""
    request, sampling = item["request"], item["request"].sampling
    finish, ids = output.finish_reason, output.output_ids
    matched = finish.get("matched")
    trim = not sampling.no_stop_trim and bool(matched)  # SGLang's detokenizer: `if not matched`
    text = engine.decode(
        ids[:-1] if trim and isinstance(matched, int) and ids else ids, sampling.skip_special_tokens
    )
    if trim and isinstance(matched, str) and matched in text:
        text = text[: text.find(matched)]

    def triples(values: list[float | None], token_ids: list[int]) -> list[list[Any]]:
        texts = (
            [engine.decode([t], False) for t in token_ids] if text_in_logprobs else [None] * len(token_ids)
        )
        return [list(x) for x in zip(values, token_ids, texts, strict=True)]

    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": finish,
        "prompt_tokens": len(request.input_ids),
        "weight_version": weight_version,
    }
    if item["return_logprob"]:
        start = request.logprob_start_len
        meta["input_token_logprobs"] = (
            triples([None], request.input_ids[-1:])
            if start < 0
            else triples(output.input_logprobs, request.input_ids[start:])
        )
        meta["output_token_logprobs"] = triples(output.output_logprobs, ids)
    meta.update(completion_tokens=len(ids), cached_tokens=0, e2e_latency=e2e_latency)
    return {"text": text, "output_ids": ids, "meta_info": meta}


def model_info_body(engine: LocalEngine) -> dict[str, Any]:
    """GET /get_model_info (and /model_info): sglang 0.5.4's fields plus the newer ones."""
    config = engine.model.config
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "served_model_name": engine.served_model_name,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    }


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error JSON (`http_server.py::_create_error_response`)."""
    return {"error": {"message": message}}
