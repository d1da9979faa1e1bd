"""A trainer shut down leaves no model and no process group behind (`MegatronTrainer.shutdown`,
`rlx.compat.megatron_teardown`): a rank kept for the next run (`rlx.actor_reuse`) would otherwise
idle with every group's gloo threads polling, more of them after each run (CPU, one process)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from rlx.config.compose import compose, to_object
from rlx.ports import free_port
from rlx.sample import Sample

GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")  # per group: one loop, two run-loop threads


def gloo_threads() -> int:
    """This process's threads that gloo runs for its live groups (Linux thread names)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() in GLOO_THREADS
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [Sample(prompt="", prompt_ids=torch.randint(2, 12, (4,), generator=g).tolist(),
                   response_ids=torch.randint(2, 16, (3,), generator=g).tolist(),
                   reward=float(i % 2), group=0, index=i) for i in range(8)]  # fmt: skip


def test_a_moe_trainer_shut_down_frees_its_model_and_every_group(tmp_path):
    from megatron.core import parallel_state

    from rlx.trainer.megatron import MegatronTrainer

    gc.collect()
    before = gloo_threads()
    # two runs in one process (the leak grew with each); PPO's critic is a second MoE model
    for algo in ("grpo", "ppo"):
        cfg = to_object(compose([f"run.output_dir={tmp_path}", "model=tiny_qwen3_moe", f"algo={algo}",
                                 "rollout.batch_size=1", "rollout.n_samples_per_prompt=8",
                                 "train.micro_batch_size=8"]))  # fmt: skip
        trainer = MegatronTrainer(cfg.model, cfg.algo, cfg.train, cfg.cluster, rank=0, world_size=1,
                                  master_addr="127.0.0.1", master_port=free_port(), seed=0, total_steps=1)  # fmt: skip
        # a training forward: the MoE dispatchers then hold routing probabilities with a graph
        trainer.train(samples())
        models = [weakref.ref(trainer.model.module)]
        if trainer.critic is not None:
            models.append(weakref.ref(trainer.critic.model.module))
        assert gloo_threads() > before
        trainer.shutdown()
        del trainer
        gc.collect()
        assert [model() for model in models] == [None] * len(models)
        assert gloo_threads() == before
        assert [k for k, v in vars(parallel_state).items() if isinstance(v, dist.ProcessGroup)] == []
