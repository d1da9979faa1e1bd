"""The policy trainer on megatron-core: one instance per rank (a Ray actor in a run).

The driver hands every rank the whole rollout batch; each data-parallel rank trains on its
own shard. Losses are normalised by counts over the whole global batch, so gradients summed
over micro-batches and averaged by DDP over data-parallel ranks equal the full-batch gradient.
An algorithm with `needs_critic` (PPO) gets a value model beside the policy (`rlx.trainer.critic`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from rlx.algo.config import AlgoConfig
from rlx.cluster import ClusterConfig
from rlx.config import build
from rlx.models.config import ModelConfig
from rlx.sample import Sample
from rlx.trainer.batch import MicroBatch, make_micro_batch, num_loss_tokens, response_slice, split
from rlx.trainer.critic import Critic
from rlx.trainer.logprobs import logprobs_and_entropy
from rlx.trainer.parallel import destroy_distributed, init_distributed
from rlx.trainer.trainable import (
    dp_sum,
    load_checkpoint,
    optimizer_step,
    run_schedule,
    save_checkpoint,
    wrap_for_training,
)
from rlx.trainer.weights import write_weight_shards

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MegatronTrainer:
    """Builds the policy (and reference, and critic) model, computes log-probs, trains, exports weights."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        algo_cfg: AlgoConfig,
        train_cfg,
        cluster_cfg: ClusterConfig,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        seed: int,
        temperature: float = 1.0,
    ):
        from megatron.core import parallel_state

        torch.set_num_threads(max(1, cluster_cfg.torch_threads))
        self.rank = rank
        self.train_cfg = train_cfg
        self.temperature = temperature
        self.device = init_distributed(
            rank, world_size, master_addr, master_port,
            tp=cluster_cfg.tensor_parallel_size, pp=cluster_cfg.pipeline_parallel_size,
            ep=cluster_cfg.expert_parallel_size, seed=seed,
        )  # fmt: skip
        # Sequence parallelism (MoE under TP) splits the sequence over TP ranks.
        self._pad_multiple = cluster_cfg.tensor_parallel_size
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.algo = build(algo_cfg)
        self.family = build(model_cfg)
        hf_dir = self.family.checkpoint_dir()
        params_dtype = _DTYPES[train_cfg.precision]

        # Megatron builds linear layers on the current device but torch norms on the CPU;
        # Megatron-LM's get_model moves the whole model afterwards, and so do we.
        model = self.family.build_model(params_dtype=params_dtype).to(self.device)
        self.family.load_hf_weights(model, hf_dir)
        self.model, self.optimizer = wrap_for_training(model, train_cfg, train_cfg.lr, params_dtype)

        self.ref_model = None
        if self.algo.needs_ref:
            self.ref_model = self.family.build_model(params_dtype=params_dtype).to(self.device)
            self.family.load_hf_weights(self.ref_model, hf_dir)
            self.ref_model.eval()
        self.critic = None
        if getattr(self.algo, "needs_critic", False):
            self.critic = Critic(
                self.family, hf_dir, algo_cfg, train_cfg,
                device=self.device, params_dtype=params_dtype, pad_multiple=self._pad_multiple, seed=seed,
            )  # fmt: skip
        self.num_updates = 0

    # ---- forward passes -------------------------------------------------------------------

    def _forward_step(self, mode: str, num_microbatches: int, data_iterator: Iterator, model):
        mb: MicroBatch = next(data_iterator)
        logits_BLV = model(input_ids=mb.tokens_BL, position_ids=mb.position_ids_BL, attention_mask=None)
        return logits_BLV, partial(self._loss, mode, num_microbatches, mb)

    def _loss(self, mode: str, num_microbatches: int, mb: MicroBatch, logits_BLV: torch.Tensor):
        logp_BL, entropy_BL = logprobs_and_entropy(
            logits_BLV[:, :-1],
            mb.tokens_BL[:, 1:],
            temperature=self.temperature,
            with_entropy=mode == "train",
        )
        logp_BT = response_slice(logp_BL, mb)
        if mode == "logprob":
            return logp_BT.sum() * 0.0, {"logp": logp_BT.detach()}
        batch = {
            "logp": logp_BT,
            "old_logp": mb.extras["old_logp"],
            "adv": mb.extras["adv"],
            "mask": mb.mask_BT,
            "entropy": response_slice(entropy_BL, mb),
        }
        batch |= {k: mb.extras[k] for k in ("ref_logp", "rollout_logp") if k in mb.extras}
        loss, metrics = self.algo.loss(batch, self._num_global_tokens, self._num_global_samples)
        metrics = {k: v.detach().float() for k, v in metrics.items()}
        # Megatron divides each micro-batch loss by num_microbatches and DDP averages over DP
        # ranks; the loss is already normalised over the global batch, so undo both.
        return loss * (num_microbatches * self.dp_size), metrics

    @torch.no_grad()
    def _logprobs(self, model, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample response log-probs [response_len] under `model`."""
        out = []
        for chunk in split(samples, self.train_cfg.micro_batch_size):
            mb = make_micro_batch(chunk, {}, self._pad_multiple).to(self.device)
            (result,) = run_schedule(
                model, partial(self._forward_step, "logprob"), [mb], self.train_cfg.micro_batch_size, True
            )
            out += [row[: s.response_len].cpu() for row, s in zip(result["logp"], chunk, strict=True)]
        return out

    # ---- training ---------------------------------------------------------------------------

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """Log-probs (and values), advantages, then `num_steps_per_rollout` optimizer steps of
        the critic (when there is one) and of the policy (unless the critic is warming up)."""
        start = time.perf_counter()
        steps = split(list(range(len(samples))), self.train_cfg.global_batch_size)
        local = [i for step in steps for i in step[self.dp_rank :: self.dp_size]]

        self.model.eval()
        logprobs = {
            "old_logp": self._gather_dp(local, self._logprobs(self.model, [samples[i] for i in local]))
        }
        if self.ref_model is not None:
            logprobs["ref_logp"] = self._gather_dp(
                local, self._logprobs(self.ref_model, [samples[i] for i in local])
            )
        inputs, values = logprobs, None
        if self.critic is not None:  # values go to the algorithm, not into every policy micro-batch
            values = self._gather_dp(local, self.critic.values([samples[i] for i in local]))
            inputs = logprobs | {"values": values}
        advantages = self.algo.advantages(samples, inputs)
        metrics = self._logprob_gap(samples, logprobs["old_logp"]) | _advantage_stats(samples, advantages)
        metrics |= {f"train/{k}": v for k, v in getattr(self.algo, "advantage_metrics", {}).items()}

        train_policy = True
        if self.critic is not None:
            train_policy = not self.critic.warming_up  # read before this rollout counts towards it
            metrics |= self.critic.train(samples, self.algo.returns, values)
        if train_policy:
            metrics |= self._train_policy(samples, steps, advantages, logprobs)
        metrics["time/train_s"] = time.perf_counter() - start
        return metrics

    def _train_policy(self, samples, steps, advantages, logprobs) -> dict[str, float]:
        """One optimizer step of the policy per global batch in `steps`."""
        cfg = self.train_cfg
        self.model.train()
        sums: dict[str, float] = {}
        grad_norms = []
        for step in steps:
            self._num_global_tokens = sum(num_loss_tokens(samples[i]) for i in step)
            self._num_global_samples = len(step)
            chunks = split(step[self.dp_rank :: self.dp_size], cfg.micro_batch_size)
            mbs = [self._micro_batch(samples, chunk, advantages, logprobs) for chunk in chunks]
            forward_step = partial(self._forward_step, "train")
            grad_norms.append(
                optimizer_step(self.model, self.optimizer, forward_step, mbs, cfg.micro_batch_size, sums)
            )
            self.num_updates += 1
        metrics = {f"train/{k}": v / len(steps) for k, v in dp_sum(sums, self.device).items()}
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _micro_batch(self, samples, chunk, advantages, logprobs) -> MicroBatch:
        extras = {"adv": [advantages[i] for i in chunk]}
        extras |= {key: [values[i] for i in chunk] for key, values in logprobs.items()}
        if all(len(samples[i].rollout_logprobs) == samples[i].response_len for i in chunk):
            extras["rollout_logp"] = [samples[i].rollout_logprobs for i in chunk]
        return make_micro_batch([samples[i] for i in chunk], extras, self._pad_multiple).to(self.device)

    def _gather_dp(self, local: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every DP rank's per-sample tensors, put back in batch order (index -> tensor)."""
        from megatron.core import parallel_state

        pairs = list(zip(local, [v.cpu() for v in values], strict=True))
        if self.dp_size > 1:
            gathered: list = [None] * self.dp_size
            torch.distributed.all_gather_object(
                gathered, pairs, group=parallel_state.get_data_parallel_group_gloo()
            )
            pairs = [pair for part in gathered for pair in part]
        by_index = dict(pairs)
        return [by_index[i] for i in range(len(by_index))]

    @staticmethod
    def _logprob_gap(samples: list[Sample], old_logp: list[torch.Tensor]) -> dict[str, float]:
        """Mean |trainer logprob - rollout logprob| over response tokens, before the update."""
        gap_sum = count = 0.0
        for s, logp in zip(samples, old_logp, strict=True):
            if len(s.rollout_logprobs) == s.response_len:
                gap_sum += float((logp - torch.tensor(s.rollout_logprobs)).abs().sum())
                count += s.response_len
        return {"train/logprob_abs_diff": gap_sum / max(count, 1.0)}

    # ---- weights ----------------------------------------------------------------------------

    def export_weights(self, out_dir: str, bucket_bytes: int = 256 << 20) -> str | None:
        """Write HF-named weights as safetensors shards of at most `bucket_bytes` into `out_dir`.

        A collective over the model-parallel group; global rank 0 writes and returns the path.
        """
        named = self.family.export_hf_weights(self.model.module)
        if self.rank != 0:
            for _ in named:  # every rank takes part in the gathers
                pass
            return None
        write_weight_shards(named, Path(out_dir), bucket_bytes)
        return out_dir

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self, ckpt_dir: str) -> None:
        """Megatron distributed checkpoint of model and optimizer (a collective over all ranks);
        the critic's goes to the sibling directory `critic_dir(ckpt_dir)`."""
        save_checkpoint(self.model, self.optimizer, ckpt_dir)
        if self.critic is not None:
            self.critic.save(critic_dir(ckpt_dir))

    def load(self, ckpt_dir: str) -> None:
        """Restore model and optimizer (and the critic) from `save`'s directory, whatever TP/DP wrote it."""
        load_checkpoint(self.model, self.optimizer, ckpt_dir)
        if self.critic is not None:
            self.critic.load(critic_dir(ckpt_dir))

    def shutdown(self) -> None:
        destroy_distributed()

    def pid(self) -> int:
        return os.getpid()


def critic_dir(ckpt_dir: str | Path) -> Path:
    """Where the critic of the policy checkpoint `ckpt_dir` lives: `<ckpt_dir>_critic`, beside it."""
    path = Path(ckpt_dir)
    return path.with_name(f"{path.name}_critic")


def _advantage_stats(samples: list[Sample], advantages: list[torch.Tensor]) -> dict[str, float]:
    """Mean, std and extremes of the advantages over loss tokens (what the policy is pushed by)."""
    values = [a[: s.response_len][torch.tensor(s.loss_mask or [1] * s.response_len, dtype=torch.bool)]
              for s, a in zip(samples, advantages, strict=True)]  # fmt: skip
    flat = torch.cat(values) if values else torch.zeros(1)
    return {
        "train/adv_mean": float(flat.mean()),
        "train/adv_std": float(flat.std()) if flat.numel() > 1 else 0.0,
        "train/adv_max": float(flat.max()),
        "train/adv_min": float(flat.min()),
    }
