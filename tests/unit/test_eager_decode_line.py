"""The run's start names a running cap above the largest decode graph (rlx.config.memory_check.
eager_decode_line): past it a decode step runs eagerly, launch-bound, with no step queued behind it."""

from __future__ import annotations

import pytest

from rlx.config.compose import compose, to_object
from rlx.config.memory_check import eager_decode_line

GPU = [
    "cluster=1gpu",
    "train.precision=bf16",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_response_len=8",
]


def test_a_running_cap_past_the_largest_graph_is_named_with_the_setting_that_graphs_it():
    # 128 prompts x 8 on one engine: LocalLauncher runs 1,024 at once; the user graphs up to 512
    rc = to_object(compose([*GPU, "rollout.batch_size=128", "train.global_batch_size=1024",
                            "+rollout.engine_args.cuda_graph_max_bs=512"]))  # fmt: skip
    line = eager_decode_line(rc)
    assert line.startswith("decode graphs hold up to 512 of each engine's 1,024 running requests"), line
    assert "(rollout.engine_args.cuda_graph_max_bs=512)" in line
    assert "rollout.engine_args.cuda_graph_max_bs=1024 graphs them all" in line
    # the user's own cap and graphs count as they are set
    rc = to_object(compose([*GPU, "rollout.batch_size=16", "train.global_batch_size=128",
                            "+rollout.engine_args.max_running_requests=300",
                            "+rollout.engine_args.cuda_graph_max_bs=64"]))  # fmt: skip
    assert "hold up to 64 of each engine's 300 running" in eager_decode_line(rc)


@pytest.mark.parametrize(
    "overrides",
    [
        [*GPU, "rollout.batch_size=64", "train.global_batch_size=512"],  # 512 running, graphs to 512
        [*GPU, "rollout.batch_size=128", "train.global_batch_size=1024"],  # 1,024 and 1,024 (defaults)
        [
            *GPU,
            "rollout.batch_size=16",
            "train.global_batch_size=128",
            "+rollout.engine_args.max_running_requests=300",
        ],  # the user's cap: graphs up to it
        [
            *GPU,
            "rollout.batch_size=128",
            "train.global_batch_size=1024",
            "+rollout.engine_args.cuda_graph_max_bs=1024",
        ],
        [
            *GPU,
            "rollout.batch_size=128",
            "train.global_batch_size=1024",
            "+rollout.engine_args.disable_cuda_graph=true",
        ],
        ["rollout.batch_size=128", "train.global_batch_size=1024"],  # CPU engines: no graphs
        [
            *GPU,
            "rollout.batch_size=128",
            "train.global_batch_size=1024",
            "rollout=sglang",
            "rollout.server_module=rlx.engine.serve",
        ],  # SGLang sizes its own
    ],
)
def test_nothing_is_said_where_every_running_request_fits_a_graph_or_none_are_captured(overrides):
    assert eager_decode_line(to_object(compose(overrides))) is None
