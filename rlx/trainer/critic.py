"""PPO's value model on megatron-core: the policy's family, shape and HF weights, with the
vocabulary output layer replaced by a freshly initialised scalar head, trained on its own
optimizer with the clipped value loss. One instance per trainer rank, beside the policy.

Shapes: B samples, L prompt+response tokens (right-padded), T response tokens (right-padded),
S sequence positions (this context-parallel rank's) and H hidden size in megatron's [S, B, H] layout.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from rlx.algo.config import AlgoConfig
from rlx.algo.losses import aggregate, clipped_value_loss
from rlx.sample import Sample
from rlx.trainer import context
from rlx.trainer.batch import MicroBatch, response_slice
from rlx.trainer.config import TrainConfig
from rlx.trainer.pipeline import build_chunks
from rlx.trainer.trainable import Trainable

_TRAINED_ROLLOUTS = "critic_trained_rollouts"  # kept in the checkpoint: warm-up survives a resume


class ValueHead(torch.nn.Linear):
    """hidden -> 1 in place of GPTModel's `output_layer`, called the way GPTModel calls that.

    Replicated on every tensor-parallel rank, so each needs the full hidden state: it already
    is full without sequence parallelism; with it (MoE under TP) the sequence shards are
    gathered here. Every TP rank then computes the same values and the same loss, so the
    gather's backward takes this rank's slice of the (already full) gradient rather than
    reduce-scattering it, which would count it TP times.
    """

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, init_std: float, seed: int, dtype):
        super().__init__(hidden_size, 1, bias=True, dtype=dtype)
        # Seeded on its own, so every TP and DP rank starts from the same head whatever the
        # global RNG went through while the trunk was built.
        with torch.no_grad():
            self.weight.normal_(0.0, init_std, generator=torch.Generator().manual_seed(seed))
            self.bias.zero_()
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_SBH: torch.Tensor, weight=None, runtime_gather_output=None):
        """`(values [S, B, 1], None)`; `weight` (a tied embedding) and `runtime_gather_output` are
        GPTModel's output-layer arguments and do not apply."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
        return super().forward(hidden_SBH), None


def attach_value_head(model: torch.nn.Module, seed: int) -> None:
    """Replace a built (and loaded) GPTModel's vocabulary output layer by a fresh `ValueHead`."""
    config = model.config
    head = ValueHead(
        config.hidden_size,
        sequence_parallel=config.sequence_parallel,
        init_std=config.init_method_std,
        seed=seed,
        dtype=config.params_dtype,
    )
    model.output_layer = head.to(next(model.parameters()).device)
    # The head shares nothing with the embedding: GPTModel must not pass it the embedding
    # weight, nor (under PP) all-reduce its gradient with the first stage's embedding.
    model.share_embeddings_and_output_weights = False


class Critic:
    """The value model: `values` before an update, `train` on returns, dist checkpoints.

    Built like the policy (`family.build_model`, `family.load_hf_weights` from the same HF
    directory), so the trunk starts as the policy's; only the head is new. Trained with Adam at
    `algo.critic_lr` (the rest of the optimizer settings are `train.*`), the same global and
    micro batches as the policy, and the clipped value loss (`algo.value_clip`), a token mean
    normalised by global token counts like the policy loss.
    """

    def __init__(
        self,
        family,
        hf_dir: str | Path,
        algo_cfg: AlgoConfig,
        train_cfg: TrainConfig,
        *,
        total_steps: int,
        device: torch.device,
        params_dtype: torch.dtype,
        pad_multiple: int,
        seed: int,
    ):
        chunks = build_chunks(family, hf_dir, params_dtype, device)  # the policy, output layer included...
        for chunk in chunks:
            if chunk.post_process:
                attach_value_head(chunk, seed)  # ...whose output layer is then replaced
            # Under PP the first stage's embedding would otherwise wait to all-reduce its gradient
            # with a tied output layer on the last stage, which the value head is not.
            chunk.share_embeddings_and_output_weights = False
        self.trainable = Trainable(
            chunks, train_cfg, peak_lr=algo_cfg.critic_lr, total_steps=total_steps, params_dtype=params_dtype,
            forward_step=self._forward_step, device=device, pad_multiple=pad_multiple,
            fuse_wgrad=family.kernels().wgrad_accumulation,
        )  # fmt: skip
        self.value_clip = algo_cfg.value_clip
        self.warmup_steps = algo_cfg.critic_warmup_steps
        self.num_trained_rollouts = 0

    @property
    def model(self):
        """The value model (megatron DDP over the GPTModel with a value head)."""
        return self.trainable.model

    @property
    def warming_up(self) -> bool:
        """True while the critic has trained on fewer than `algo.critic_warmup_steps` rollouts
        (the policy waits, so its first updates use values that mean something)."""
        return self.num_trained_rollouts < self.warmup_steps

    # ---- forward passes -------------------------------------------------------------------

    def _forward_step(self, mode: str, num_microbatches: int, data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        values_BS1 = model(**context.model_inputs(mb))  # this CP rank's positions (all without CP)
        return values_BS1, partial(self._loss, mode, num_microbatches, mb)

    def _loss(self, mode: str, num_microbatches: int, mb: MicroBatch, values_BS1: torch.Tensor):
        # Position p has seen tokens <= p: its value is that of the state before token p + 1,
        # the position whose logits predict that token, so log-probs' alignment applies.
        values_BT = response_slice(context.position_values(values_BS1[:, :, 0].float()), mb)
        if mode == "values":
            return values_BT.sum() * 0.0, {"values": values_BT.detach()}
        loss_BT, clipfrac_BT = clipped_value_loss(
            values_BT, mb.extras["old_values"], mb.extras["returns"], self.value_clip
        )
        agg = partial(
            aggregate,
            mask_BT=mb.mask_BT,
            mode="token_mean",
            num_global_tokens=mb.num_global_tokens,
            num_global_samples=mb.num_global_samples,  # unused by token_mean
        )
        loss = agg(loss_BT)
        metrics = {"value_loss": loss.detach(), "value_clipfrac": agg(clipfrac_BT)}
        # as in the policy's loss: undo megatron's 1 / num_microbatches and DDP's DP average
        return loss * (num_microbatches * self.trainable.dp_size), metrics

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample values [response_len]: entry t is the value of the state before response
        token t (computed at the position whose logits predict it)."""
        return self.trainable.forward_only(samples, "values", "values")

    # ---- training ---------------------------------------------------------------------------

    def train(
        self, samples: list[Sample], returns: list[torch.Tensor], old_values: list[torch.Tensor]
    ) -> dict[str, float]:
        """`train.num_steps_per_rollout` optimizer steps of the clipped value loss on the whole
        rollout batch (every rank gets all of it and trains on its DP shard, as the policy does).

        `returns` are the targets and `old_values` the values `values` gave before this update,
        one [response_len] tensor per sample, in batch order.
        """
        metrics = self.trainable.train(samples, {"returns": returns, "old_values": old_values})
        self.num_trained_rollouts += 1
        renamed = {"grad_norm": "critic_grad_norm", "lr": "critic_lr"}
        return {f"train/{renamed.get(k, k)}": v for k, v in metrics.items()}

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self, ckpt_dir: str | Path) -> None:
        """Megatron dist checkpoint of the critic and its optimizer, plus its warm-up count."""
        self.trainable.save(ckpt_dir, {_TRAINED_ROLLOUTS: self.num_trained_rollouts})

    def load(self, ckpt_dir: str | Path) -> None:
        """Restore what `save` wrote, whatever TP/DP wrote it."""
        if not Path(ckpt_dir).is_dir():
            raise FileNotFoundError(
                f"no critic checkpoint at {ckpt_dir}: the checkpoint was written by an algorithm without a critic"
            )
        common = self.trainable.load(ckpt_dir, (_TRAINED_ROLLOUTS,))
        self.num_trained_rollouts = int(common[_TRAINED_ROLLOUTS])
