"""The trainer ranks as Ray actors, driven together."""

from __future__ import annotations

import ray

from rlx.ports import free_port
from rlx.trainer.megatron import MegatronTrainer


class TrainerGroup:
    """`cluster.num_trainer_procs` MegatronTrainer actors forming one torch.distributed world."""

    def __init__(self, cfg, actor_options: list[dict] | None = None):
        """`actor_options`: Ray options per rank (`rlx.placement.plan(...).trainer`); default: CPU."""
        options = actor_options or [{"num_cpus": 0}] * cfg.cluster.num_trainer_procs
        num_procs = len(options)
        port = free_port()
        actor_cls = ray.remote(MegatronTrainer)
        self.actors = [
            actor_cls.options(**options[rank]).remote(
                cfg.model,
                cfg.algo,
                cfg.train,
                cfg.cluster,
                rank=rank,
                world_size=num_procs,
                master_addr="127.0.0.1",
                master_port=port,
                seed=cfg.run.seed,
                total_steps=cfg.run.num_rollout * cfg.train.num_steps_per_rollout,
                temperature=cfg.rollout.temperature,
            )  # fmt: skip
            for rank in range(num_procs)
        ]

    def train(self, samples) -> dict[str, float]:
        samples_ref = ray.put(samples)  # one copy in the object store, shared by every rank
        return ray.get([a.train.remote(samples_ref) for a in self.actors])[0]

    def offload(self) -> dict[str, float]:
        """Colocated GPUs: every rank's models and optimizer state to CPU; rank 0's memory figures."""
        return ray.get([a.offload.remote() for a in self.actors])[0]

    def onload(self) -> dict[str, float]:
        """Colocated GPUs: every rank back onto its GPU; rank 0's memory figures from just before."""
        return ray.get([a.onload.remote() for a in self.actors])[0]

    def push_weights(self, method: str, engine_urls: list[str], version: int, bucket_bytes: int) -> int:
        """The policy's weights straight to the engines (`tensor` or `distributed`); tensors sent."""
        refs = [a.push_weights.remote(method, engine_urls, version, bucket_bytes) for a in self.actors]
        return ray.get(refs)[0]

    def async_init_weight_group(self, master_address: str, master_port: int, world_size: int, backend: str):
        """Rank 0 starts hosting the engines' broadcast group; Ray refs (they resolve once all joined)."""
        return [
            a.init_weight_group.remote(master_address, master_port, world_size, backend) for a in self.actors
        ]

    def export_weights(self, out_dir: str) -> str:
        return ray.get([a.export_weights.remote(out_dir) for a in self.actors])[0]

    def save(self, ckpt_dir: str) -> None:
        ray.get([a.save.remote(ckpt_dir) for a in self.actors])

    def load(self, ckpt_dir: str) -> None:
        ray.get([a.load.remote(ckpt_dir) for a in self.actors])

    def shutdown(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        finally:
            for a in self.actors:
                ray.kill(a)
