"""The remote reward model against a real HTTP server on loopback: normal, batched, slow, failing
then recovering, refusing, answering nonsense, down mid-run and down at start. CPU, a few seconds."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlx.errors import ConfigError
from rlx.reward import load_scorer
from rlx.reward.config import RewardConfig
from rlx.reward.remote import RemoteReward
from rlx.sample import Sample, Status


class RewardServer:
    """An OpenRLHF-style reward server: POST answers {"rewards": [...]}, one per `query`, 1.0 when the
    query ends with its label. `script` lists what the next requests get: "ok", "slow" (sleep past
    the client's limit, then answer), an HTTP status code, or a body to send as is."""

    def __init__(self):
        self.requests: list[dict] = []
        self.script: list = []
        self.slow_s = 3.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # a POST-only route, as OpenRLHF's serve_rm has
                self._reply(405, {"detail": "Method Not Allowed"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                action = server.script.pop(0) if server.script else "ok"
                if action == "slow":
                    time.sleep(server.slow_s)
                    action = "ok"
                if isinstance(action, int):
                    self._reply(action, {"error": "scripted failure"})
                elif action == "ok":
                    rewards = [
                        float(q.endswith(lab)) for q, lab in zip(body["query"], body["labels"], strict=True)
                    ]
                    self._reply(200, {"rewards": rewards, "extra_logs": {}})
                else:
                    self._reply(200, action)

            def _reply(self, status, payload):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout): nobody reads this answer
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.stop()


def cfg_for(url: str, **kw) -> RewardConfig:
    defaults = dict(
        url=url, timeout_s=2.0, batch_size=4, batch_wait_s=0.05, max_retries=2, retry_backoff_s=0.05
    )
    return RewardConfig(**(defaults | kw))


def group_of(group: int, *responses: str, label: str = "3") -> list[Sample]:
    return [
        Sample(
            prompt=f"q{group}: 1+2=",
            prompt_ids=[7, group],
            label=label,
            group=group,
            index=i,
            response_ids=[1, 2],
            response_text=r,
            loss_mask=[1, 1],
            status=Status.COMPLETED,
            metadata={"source": "test"},
        )
        for i, r in enumerate(responses)
    ]


def run(scorer, *groups):
    async def go():
        await asyncio.gather(*(scorer.score_group(g) for g in groups))
        await scorer.aclose()

    asyncio.run(go())
    return scorer.metrics()


class PromptTokenizer:
    """Renders prompt ids as the model's template would (what OpenRLHF servers get as `query`)."""

    def decode(self, ids, skip_special_tokens=True):
        assert not skip_special_tokens
        return f"<user>{ids}<assistant>"


def test_groups_are_batched_and_scored(server):
    scorer = load_scorer(cfg_for(server.url), tokenizer=PromptTokenizer())
    g0, g1 = group_of(0, "3", "4", "it is 3"), group_of(1, "5", "3", "x")
    metrics = run(scorer, g0, g1)
    assert [s.reward for s in g0 + g1] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert all(s.status is Status.COMPLETED for s in g0 + g1)
    # 6 samples from two groups, batch_size 4: one full batch, then the rest after batch_wait_s
    assert [len(r["query"]) for r in server.requests] == [4, 2]
    first = server.requests[0]
    assert first["samples"][0] == {
        "prompt": "q0: 1+2=",
        "response": "3",
        "label": "3",
        "metadata": {"source": "test"},
    }
    assert first["prompts"][0] == "<user>[7, 0]<assistant>"
    assert first["query"][3] == "<user>[7, 1]<assistant>5"  # prompt text + response, OpenRLHF's query
    assert first["labels"] == ["3"] * 4
    assert (metrics["reward/num_scored"], metrics["reward/num_requests"], metrics["reward/num_failed"]) == (
        6,
        2,
        0,
    )


def test_slow_answer_times_out_and_the_retry_succeeds(server):
    server.script = ["slow"]
    scorer = load_scorer(cfg_for(server.url, timeout_s=1.0))
    g = group_of(0, "3", "4")
    metrics = run(scorer, g)
    assert [s.reward for s in g] == [1.0, 0.0]
    assert (metrics["reward/num_requests"], metrics["reward/num_retries"]) == (2, 1)


def test_failing_then_recovering_is_retried(server):
    server.script = [503, 500]  # two failures, max_retries=2: the third attempt answers
    scorer = load_scorer(cfg_for(server.url))
    g = group_of(0, "3")
    metrics = run(scorer, g)
    assert g[0].reward == 1.0 and g[0].status is Status.COMPLETED
    assert (metrics["reward/num_requests"], metrics["reward/num_retries"], metrics["reward/num_failed"]) == (
        3,
        2,
        0,
    )


def test_a_server_that_keeps_timing_out_fails_the_samples(server):
    server.script = ["slow"] * 3
    server.slow_s = 0.6
    scorer = load_scorer(cfg_for(server.url, timeout_s=0.2))
    g = group_of(0, "3", "4")
    metrics = run(scorer, g)
    assert all(s.metadata["reward_failed"] == "unavailable" for s in g)
    assert "failed 3 times; last: no answer within reward.timeout_s=0.2" in g[0].status_reason
    assert metrics["reward/failed_unavailable"] == 2


@pytest.mark.parametrize(
    "answer, reason, text",
    [
        (400, "remote_error", "answered 400"),  # the request is wrong: not retried
        ({"scores": [1.0]}, "remote_error", 'not {"rewards": [...]}'),
        ({"rewards": [1.0, 1.0]}, "wrong_count", "returned 2 rewards for 1 samples"),
        ({"rewards": ["high"]}, "not_a_number", "returned str 'high', not a number"),
    ],
)
def test_refusals_and_bad_answers_fail_at_once(server, answer, reason, text):
    server.script = [answer]
    scorer = load_scorer(cfg_for(server.url))
    g = group_of(0, "3")
    metrics = run(scorer, g)
    assert g[0].status is Status.FAILED and g[0].metadata["reward_failed"] == reason
    assert text in g[0].status_reason
    assert metrics["reward/num_requests"] == 1


def test_server_down_mid_run_fails_samples_as_configured(server):
    scorer = load_scorer(cfg_for(server.url, on_failure="zero"))
    server.stop()  # it answered the start check, then went away
    g = group_of(0, "3", "4")
    metrics = run(scorer, g)
    assert all(s.metadata["reward_failed"] == "unavailable" for s in g)
    assert all(s.reward == 0.0 and s.loss_mask == [1, 1] for s in g)  # zero: trained with reward 0
    assert "failed 3 times; last: ClientConnectorError" in g[0].status_reason
    assert (metrics["reward/num_requests"], metrics["reward/failed_unavailable"]) == (3, 2)


def test_server_down_at_start_is_a_config_error():
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = cfg_for(f"http://127.0.0.1:{port}/get_reward", max_retries=1)
    with pytest.raises(
        ConfigError, match=rf"reward.url='http://127.0.0.1:{port}/get_reward' does not answer"
    ):
        load_scorer(cfg)


def test_rewards_as_objects_with_reward_key(server):
    server.script = [{"rewards": [{"score": 0.5, "format": 1.0}]}]
    scorer = RemoteReward(replace(cfg_for(server.url), reward_key="score"))
    g = group_of(0, "3")
    run(scorer, g)
    assert g[0].reward == 0.5 and g[0].metadata["reward_info"] == {"score": 0.5, "format": 1.0}
