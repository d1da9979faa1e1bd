"""The policy trainer on megatron-core: one instance per rank (a Ray actor in a run).

The driver hands every rank the whole rollout batch; each data-parallel rank trains on its
own shard. Losses are normalised by counts over the whole global batch, so gradients summed
over micro-batches and averaged by DDP over data-parallel ranks equal the full-batch gradient.
An algorithm with `needs_critic` (PPO) gets a value model beside the policy (`rlx.trainer.critic`).
Under pipeline parallelism every rank still gets the whole batch and returns the same metrics:
log-probs, values and loss metrics come from the last stage (`rlx.trainer.pipeline`), and weight
exports gather every stage (`rlx.models.stages`). Under context parallelism the CP ranks of a DP
rank build the same micro-batches, the model sees each rank's share of every sequence, and
per-token outputs are gathered back whole before the loss (`rlx.trainer.context`).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from rlx.algo.base import Advantages
from rlx.algo.config import AlgoConfig
from rlx.algo.policy_gradient import flat_loss_mask
from rlx.cluster import ClusterConfig
from rlx.compat import megatron_teardown
from rlx.config import build
from rlx.flat import flat_tensor
from rlx.lora.apply import apply_lora
from rlx.lora.apply import disabled as adapters_disabled
from rlx.models.config import ModelConfig
from rlx.models.precision import half_precision
from rlx.sample import Sample
from rlx.trainer import context
from rlx.trainer.batch import MicroBatch, pad_multiple, response_slice
from rlx.trainer.config import PRECISION_DTYPES, TrainConfig
from rlx.trainer.critic import Critic
from rlx.trainer.megatron_check import megatron_overrides
from rlx.trainer.offload import Offloader, gpu_memory_gib
from rlx.trainer.parallel import destroy_distributed, init_distributed
from rlx.trainer.pipeline import build_chunks, virtual_stages
from rlx.trainer.profiling import profiled
from rlx.trainer.trainable import Trainable
from rlx.trainer.weight_push import WeightPusher
from rlx.trainer.weights import write_weight_shards

log = logging.getLogger(__name__)


class MegatronTrainer:
    """Builds the policy (and reference, and critic) model, computes log-probs, trains, exports weights."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        algo_cfg: AlgoConfig,
        train_cfg: TrainConfig,
        cluster_cfg: ClusterConfig,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        seed: int,
        total_steps: int,
        temperature: float = 1.0,
        store=None,
        api_key: str | None = None,
    ):
        """`total_steps`: the run's optimizer steps (run.num_rollout x train.num_steps_per_rollout),
        over which the learning-rate schedule runs. `store`: the rendezvous store rank 0 already
        hosts (`rlx.trainer.parallel.rendezvous_store`); without one, rank 0 hosts it at
        `master_addr:master_port` and the others join it there. `api_key`: the run's, which the
        engines require of the weights pushed to them (`rlx.ports`)."""
        torch.set_num_threads(max(1, cluster_cfg.torch_threads))
        self.rank, self._world_size = rank, world_size
        self._pusher = WeightPusher(api_key)  # the fast weight paths (no connection until first used)
        self.temperature = temperature
        self.device = init_distributed(
            rank, world_size, master_addr, master_port,
            tp=cluster_cfg.tensor_parallel_size, pp=cluster_cfg.pipeline_parallel_size,
            ep=cluster_cfg.expert_parallel_size, vp=virtual_stages(model_cfg.megatron_overrides),
            cp=cluster_cfg.context_parallel_size, seed=seed, store=store,
        )  # fmt: skip
        # Sequence parallelism (MoE under TP) splits the sequence over TP ranks, CP over CP ranks.
        padding = pad_multiple(cluster_cfg.tensor_parallel_size, cluster_cfg.context_parallel_size)
        self.algo = build(algo_cfg)
        # recompute and the pipeline schedule's flags, then the model's own (rlx.trainer.megatron_check,
        # which builds the same TransformerConfig in the driver when the config is composed)
        overrides = megatron_overrides(model_cfg, train_cfg, cluster_cfg)
        self.family = build(replace(model_cfg, megatron_overrides=overrides))
        hf_dir = self.family.checkpoint_dir()
        params_dtype = getattr(torch, PRECISION_DTYPES[train_cfg.precision])
        # half-precision logits reach the loss as they are (Float16Module would copy them to fp32)
        self._logits_kwargs = {} if params_dtype == torch.float32 else {"fp32_output": False}

        chunks = build_chunks(self.family, hf_dir, params_dtype, self.device)
        self.lora = train_cfg.lora if train_cfg.lora.enabled else None
        if self.lora is not None:  # adapters before DDP and the optimizer: they alone train
            for chunk in chunks:
                apply_lora(chunk, self.lora, seed)
        self.policy = Trainable(
            chunks, train_cfg, peak_lr=train_cfg.lr, total_steps=total_steps, params_dtype=params_dtype,
            forward_step=self._forward_step, device=self.device, pad_multiple=padding,
            fuse_wgrad=self.family.kernels().wgrad_accumulation,
            lora=None if self.lora is None else asdict(self.lora),
        )  # fmt: skip
        # The reference model's chunks (frozen); under LoRA the reference is the policy's own
        # base, its adapters switched off (`_reference_logprobs`): no second copy.
        self.ref_chunks = None
        if self.algo.needs_ref and self.lora is None:
            chunks = build_chunks(self.family, hf_dir, params_dtype, self.device)
            self.ref_chunks = [half_precision(chunk).eval() for chunk in chunks]
            self._ref_offloaders = [Offloader(chunk) for chunk in self.ref_chunks]
        self.critic = None
        if self.algo.needs_critic:
            self.critic = Critic(
                self.family, hf_dir, algo_cfg, train_cfg, total_steps=total_steps,
                device=self.device, params_dtype=params_dtype, pad_multiple=padding, seed=seed,
            )  # fmt: skip

    @property
    def model(self):
        """The policy (megatron DDP over the GPTModel; its first chunk under virtual stages)."""
        return self.policy.model

    # ---- colocated GPUs -------------------------------------------------------------------------

    def _offloaders(self) -> list[Offloader]:
        ref = self._ref_offloaders if self.ref_chunks is not None else []
        return [*self.policy.offloaders, *ref, *(self.critic.trainable.offloaders if self.critic else [])]

    def offload(self, move_state: bool = True, keep_params: bool = False) -> dict[str, float]:
        """Every model and optimizer state of this rank to pinned CPU memory (unless not
        `move_state`) and its gradient buffers freed (the engines take the GPU); the GPU memory this
        process still holds, and the device's. `keep_params`: the models' parameters stay for a
        weight sync, until the next `offload()`."""
        for offloader in self._offloaders():
            offloader.offload(move_state, keep_params)
        return {f"colocate/trainer_offloaded_{k}": v for k, v in gpu_memory_gib().items()}

    def onload(self) -> dict[str, float]:
        """Back onto the GPU; the device's memory use just before (what the engines left behind),
        and the seconds on this rank: all of it, and the gradient buffers' reallocation within."""
        before = {f"colocate/before_onload_{k}": v for k, v in gpu_memory_gib().items()}
        start, grads_s = time.perf_counter(), 0.0
        for offloader in self._offloaders():
            grads_s += offloader.onload(self.device)
        return before | {
            "time/colocate/trainer_onload_on_rank_s": time.perf_counter() - start,
            "time/colocate/trainer_onload_grad_buffers_s": grads_s,
        }

    # ---- forward passes -------------------------------------------------------------------

    def _forward_step(self, mode: str, num_microbatches: int, data_iterator: Iterator, model):
        mb: MicroBatch = next(data_iterator)
        logits_BSV = model(**context.model_inputs(mb), **self._logits_kwargs)  # this CP rank's positions
        return logits_BSV, partial(self._loss, mode, num_microbatches, mb)

    def _loss(self, mode: str, num_microbatches: int, mb: MicroBatch, logits_BSV: torch.Tensor):
        logp_BL, entropy_BL = context.next_token_logprobs(
            logits_BSV, mb.tokens_BL, temperature=self.temperature, with_entropy=mode == "train"
        )
        logp_BT = response_slice(logp_BL, mb)
        if mode == "logprob":
            return logp_BT.sum() * 0.0, {"logp": logp_BT.detach()}
        batch = {"logp": logp_BT, "mask": mb.mask_BT, "entropy": response_slice(entropy_BL, mb)} | mb.extras
        gap = {}
        if "old_logp" not in batch:  # the weights have not moved yet: this pass is the old policy's
            batch["old_logp"] = logp_BT.detach()
            # the mean over the global batch's loss tokens, as `logprob_gap`, summed over micro-batches
            diff_BT = (logp_BT.detach() - batch["rollout_logp"]).abs() * mb.mask_BT
            gap["logprob_abs_diff"] = diff_BT.sum() / max(mb.num_global_tokens, 1)
        loss, metrics = self.algo.loss(batch, mb.num_global_tokens, mb.num_global_samples)
        metrics = {k: v.detach().float() for k, v in (metrics | gap).items()}
        # Megatron divides each micro-batch loss by num_microbatches and DDP averages over DP
        # ranks; the loss is already normalised over the global batch, so undo both. (DDP's
        # average over CP ranks megatron's schedule undoes itself: `rlx.trainer.context`.)
        return loss * (num_microbatches * self.policy.dp_size), metrics

    def _logprobs(self, chunks: list, samples: list[Sample]) -> list[torch.Tensor]:
        """Every sample's response log-probs [response_len] under the model `chunks` (the policy's
        or the reference's), each DP rank computing its shard, gathered in batch order."""
        return self._on_dp_shards(
            samples, lambda shard: self.policy.forward_only(shard, "logprob", "logp", chunks)
        )

    def _reference_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Log-probs under the frozen reference: its own chunks, or under LoRA the policy with its
        adapters off (the base model the adapters started from)."""
        if self.ref_chunks is not None:
            return self._logprobs(self.ref_chunks, samples)
        with adapters_disabled(self.policy.chunks):
            return self._logprobs(self.policy.chunks, samples)

    # ---- training ---------------------------------------------------------------------------

    def train(self, samples: list[Sample], profile: tuple[str, int] | None = None) -> dict[str, float]:
        """Log-probs (and values), advantages, then `num_steps_per_rollout` optimizer steps of
        the critic (when there is one) and of the policy (unless the critic is warming up).
        `profile`: (directory, step) to run it under torch.profiler (rlx.trainer.profiling)."""
        if profile is None:
            return self._train(samples)
        directory, step = profile
        with profiled(Path(directory), f"step_{step:06d}_rank_{self.rank}"):
            return self._train(samples)

    def _train(self, samples: list[Sample]) -> dict[str, float]:
        start = time.perf_counter()
        # without old_logp, the loss takes the training forward's own (see train.old_logprobs)
        recompute = not self._old_logp_from_training_pass(samples)
        logprobs = {"old_logp": self._logprobs(self.policy.chunks, samples)} if recompute else {}
        if self.algo.needs_ref:
            logprobs["ref_logp"] = self._reference_logprobs(samples)
        inputs = dict(logprobs)
        if self.critic is not None:  # values go to the algorithm, not into every policy micro-batch
            inputs["values"] = self._on_dp_shards(samples, self.critic.values)
        logprobs_s = time.perf_counter() - start  # the forward-only passes before any update
        result: Advantages = self.algo.advantages(samples, inputs)
        metrics = advantage_stats(samples, result.advantages)
        if recompute:
            metrics |= logprob_gap(samples, logprobs["old_logp"])
        if recompute or self.algo.needs_ref or self.critic is not None:  # a pass ran
            metrics["time/logprobs_s"] = logprobs_s
        metrics |= {f"train/{k}": v for k, v in result.metrics.items()}

        train_policy = True
        if self.critic is not None:
            train_policy = not self.critic.warming_up  # read before this rollout counts towards it
            metrics |= self.critic.train(samples, result.returns, inputs["values"])
        if train_policy:
            extras = {"adv": result.advantages, **logprobs}
            if all(len(s.rollout_logprobs) == s.response_len for s in samples):
                extras["rollout_logp"] = rollout_logprobs(samples)
            metrics |= {f"train/{k}": v for k, v in self.policy.train(samples, extras).items()}
        metrics["time/train_s"] = time.perf_counter() - start
        if self.device.type == "cuda":
            metrics["perf/trainer_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            # the whole device's memory in use as training ends (every process): colocated, the
            # trainer's reserved memory beside what the engines keep (all of theirs where nothing
            # is released: cluster.release_memory), the figure the plan's training phase predicts
            free, total = torch.cuda.mem_get_info()
            metrics["perf/gpu_used_gib"] = (total - free) / 2**30
        else:  # the process's peak resident memory (Linux: KiB), start-up included
            metrics["perf/trainer_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return metrics

    def _old_logp_from_training_pass(self, samples: list[Sample]) -> bool:
        """Whether the training pass's log-probs, detached, are the old policy's (train.old_logprobs)."""
        return (
            self.policy.cfg.old_logprobs == "auto"
            and len(self.policy.global_batches(len(samples))) == 1  # no update before any forward
            and not getattr(self.algo, "needs_old_logp", True)  # the advantages do not read them
            and all(len(s.rollout_logprobs) == s.response_len for s in samples)  # the gap, in the loss
            and not (self.critic is not None and self.critic.warming_up)  # the policy trains this step
        )

    def _on_dp_shards(self, samples: list[Sample], compute) -> list[torch.Tensor]:
        """`compute(shard) -> one tensor per sample` on this DP rank's shard of the batch (the policy
        and the critic shard alike: same global and micro batches), every rank's results gathered
        back in batch order."""
        from megatron.core import parallel_state

        local = self.policy.local_indices(len(samples))
        values = compute([samples[i] for i in local])
        pairs = list(zip(local, [v.cpu() for v in values], strict=True))
        if self.policy.dp_size > 1:
            gathered: list = [None] * self.policy.dp_size
            torch.distributed.all_gather_object(
                gathered, pairs, group=parallel_state.get_data_parallel_group_gloo()
            )
            pairs = [pair for part in gathered for pair in part]
        by_index = dict(pairs)
        return [by_index[i] for i in range(len(by_index))]

    # ---- weights ----------------------------------------------------------------------------

    def export_weights(self, out_dir: str, bucket_bytes: int = 256 << 20) -> str | None:
        """Write HF-named weights as safetensors shards of at most `bucket_bytes` into `out_dir`.

        A collective over the model-parallel group; global rank 0 writes and returns the path.
        """
        named = self.family.export_hf_weights([chunk.module for chunk in self.policy.chunks])
        if self.rank != 0:
            for _ in named:  # every rank takes part in the gathers
                pass
            return None
        write_weight_shards(named, Path(out_dir), bucket_bytes)
        return out_dir

    def export_adapter(self, out_dir: str) -> str | None:
        """Write the policy's LoRA adapters as a PEFT directory (`rlx.lora.peft`) for its base
        model, the HF checkpoint it trains from. A collective over the model-parallel group;
        global rank 0 writes and returns the path."""
        from megatron.core import parallel_state

        from rlx.lora.peft import peft_tensors, unsupported, write_peft
        from rlx.models.stages import gather_stages

        if self.lora is None:
            raise ValueError("export_adapter: this policy has no LoRA adapters (train.lora.rank is unset)")
        if reason := unsupported(self.family.cfg, self.lora):
            raise ValueError(f"export_adapter: no PEFT export: {reason}")
        bridge = self.family.weight_bridge()
        tp = (
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )
        named = gather_stages([peft_tensors(bridge, chunk, *tp) for chunk in self.policy.chunks])
        if self.rank != 0:
            for _ in named:  # every rank takes part in the gathers
                pass
            return None
        return str(write_peft(named, Path(out_dir), asdict(self.lora), self.family.checkpoint_dir()))

    def push_weights(self, method: str, engine_urls: list[str], version: int, bucket_bytes: int) -> int:
        """Send the policy's HF-named weights straight to the engines (`rlx.trainer.weight_push`):
        `tensor` (a CUDA IPC handle a tensor) or `tensor_flat` (one a bucket: rlx's engines), rank r
        to engines r, r + R, ...; `distributed`, rank 0 broadcasts (after `init_weight_group`). A
        collective over the model-parallel group; returns tensors sent."""
        named = self.family.export_hf_weights([chunk.module for chunk in self.policy.chunks])
        if method in ("tensor", "tensor_flat"):
            urls = engine_urls[self.rank :: self._world_size]
            return self._pusher.tensor(named, urls, version, bucket_bytes, flat=method == "tensor_flat")
        if self.rank != 0:
            return sum(1 for _ in named)  # every rank takes part in the gathers
        return self._pusher.distributed(named, engine_urls, version, bucket_bytes)

    def host_weight_group(self, master_address: str) -> int:
        """Rank 0: start hosting the engines' broadcast group on `master_address`; its port."""
        return self._pusher.host_group(master_address)

    def init_weight_group(self, master_address: str, master_port: int, world_size: int, backend: str) -> None:
        """Rank 0 hosts the engines' broadcast group (blocks until they have joined); others: nothing."""
        if self.rank == 0:
            self._pusher.init_group(master_address, master_port, world_size, backend)

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self, ckpt_dir: str) -> None:
        """Megatron distributed checkpoint of model and optimizer (a collective over all ranks);
        the critic's goes to the sibling directory `critic_dir(ckpt_dir)`."""
        self.policy.save(ckpt_dir)
        if self.critic is not None:
            self.critic.save(critic_dir(ckpt_dir))

    def load(self, ckpt_dir: str) -> None:
        """Restore model and optimizer (and the critic) from `save`'s directory, whatever TP/DP wrote it."""
        self.policy.load(ckpt_dir)
        if self.critic is not None:
            self.critic.load(critic_dir(ckpt_dir))

    def shutdown(self) -> None:
        """Close the weight paths and leave the process groups. The MoE layers' last routing
        probabilities go first: their autograd graph would keep every model, and the groups it
        holds, alive after the caller lets go of this trainer (`rlx.compat.megatron_teardown`)."""
        critic = self.critic.trainable.chunks if self.critic is not None else []
        megatron_teardown.drop_router_graphs([*self.policy.chunks, *(self.ref_chunks or []), *critic])
        self._pusher.close()
        destroy_distributed()

    def pid(self) -> int:
        return os.getpid()


def critic_dir(ckpt_dir: str | Path) -> Path:
    """Where the critic of the policy checkpoint `ckpt_dir` lives: `<ckpt_dir>_critic`, beside it."""
    path = Path(ckpt_dir)
    return path.with_name(f"{path.name}_critic")


def logprob_gap(samples: list[Sample], old_logp: list[torch.Tensor]) -> dict[str, float]:
    """Mean |trainer logprob - rollout logprob| over loss tokens (the model's own: tool output
    carries no rollout logprob), before the update."""
    have = [i for i, s in enumerate(samples) if len(s.rollout_logprobs) == s.response_len]
    if not have:
        return {"train/logprob_abs_diff": 0.0}
    logp = torch.cat([old_logp[i] for i in have]).double()
    rollout = flat_tensor((samples[i].rollout_logprobs for i in have), torch.float64)
    gap = (logp - rollout).abs()[flat_loss_mask([samples[i] for i in have])]
    return {"train/logprob_abs_diff": float(gap.sum()) / max(gap.numel(), 1)}


def rollout_logprobs(samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample's engine log-probs as a float32 tensor [response_len] (views of one tensor)."""
    flat = flat_tensor(s.rollout_logprobs for s in samples)
    return list(flat.split([s.response_len for s in samples]))


def advantage_stats(samples: list[Sample], advantages: list[torch.Tensor]) -> dict[str, float]:
    """Mean, std and extremes of the advantages over loss tokens (what the policy is pushed by)."""
    values = [a[: s.response_len] for s, a in zip(samples, advantages, strict=True)]
    flat = torch.cat(values)[flat_loss_mask(samples)] if values else torch.zeros(1)
    return {
        "train/adv_mean": float(flat.mean()),
        "train/adv_std": float(flat.std()) if flat.numel() > 1 else 0.0,
        "train/adv_max": float(flat.max()),
        "train/adv_min": float(flat.min()),
    }
