"""rlx's engine server as a child process, with sglang.launch_server's flag names (`__main__` runs it):

    python -m rlx.engine.serve --model-path DIR --host 127.0.0.1 --port 30000 --random-seed 0

SGLang flags the engine has no use for are accepted and ignored, so `rollout=sglang` with
`rollout.server_module=rlx.engine.serve` starts it exactly as it starts SGLang. With `--api-key`
every route but /health requires `Authorization: Bearer KEY` (`rlx.engine.serve.app`); a run hands
the key over in the environment instead (`rlx.rollout.keyed_launch`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from rlx.engine.local import LocalEngine
from rlx.engine.serve.server import EngineServer

logger = logging.getLogger(__name__)


def arg_parser() -> argparse.ArgumentParser:
    """sglang.launch_server's flag names, those the local engine uses."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # an unknown SGLang flag must not match ours by prefix
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` (all routes but /health); see rlx.rollout.keyed_launch",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """CLI with sglang.launch_server's flag names; unknown SGLang flags are accepted and ignored."""
    args, unknown = arg_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if unknown:
        logger.info("ignoring SGLang flags the local engine has no use for: %s", unknown)
    engine_args = {
        k: v
        for k, v in {
            "tokenizer_path": args.tokenizer_path,
            "context_length": args.context_length,
            "served_model_name": args.served_model_name,
            "weight_version": args.weight_version,
        }.items()
        if v is not None
    }
    engine = LocalEngine(
        args.model_path,
        dtype=args.dtype,
        seed=args.random_seed,
        max_batch_size=args.max_running_requests,
        num_threads=args.num_threads,
        **engine_args,
    )
    server = EngineServer(engine, args.host, args.port, api_key=args.api_key).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"rlx engine serving {args.model_path} on {server.url}", flush=True)
    while not stop.wait(1.0):
        pass
    server.stop()
