"""The megatron-on-CPU boundary (`rlx.compat.megatron_cpu`) and the SDPA core attention (CPU).

The last test trains a tiny Qwen3 through megatron's own training stack (DDP,
`get_megatron_optimizer`, grad clipping, `get_forward_backward_func`) in one process and over
two data-parallel gloo ranks, which is the path `rlx.trainer` runs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import megatron_world, spawn_ranks  # tests/ is on sys.path (conftest)
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.overrides import _get_current_function_mode_stack

from rlx.compat import megatron_cpu
from rlx.models.attention import SDPAttention
from rlx.models.config import ModelConfig
from rlx.models.qwen3 import Qwen3

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the boundary is inert with a GPU")


@pytest.fixture(scope="module")
def world():
    """One gloo rank with megatron's parallel state (TP=1, DP=1) for this module."""
    with megatron_world():
        yield


def test_apply_is_idempotent_and_pushes_one_mode():
    assert megatron_cpu.apply() is True
    assert megatron_cpu.apply() is True
    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, megatron_cpu._CpuDeviceMode)]
    assert len(modes) == 1
    assert megatron_cpu.is_applied()
    assert torch.cuda.is_available() is False  # the boundary never pretends a GPU exists


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(3, device="cuda"),
        lambda: torch.zeros(3, device=torch.device("cuda", 0)),
        lambda: torch.ones(3, device=torch.cuda.current_device()),
        lambda: torch.arange(3, device="cuda:0"),
        lambda: torch.tensor([1.0, 2.0, 3.0]).cuda(),
        lambda: torch.tensor([1.0, 2.0, 3.0]).to("cuda"),
        lambda: torch.tensor([1.0, 2.0, 3.0]).to(device="cuda", dtype=torch.float64),
        lambda: torch.tensor([1.0, 2.0, 3.0]).to(torch.cuda.current_device()),
        lambda: torch.tensor([1.0, 2.0, 3.0]).pin_memory(),
    ],
)
def test_cuda_tensors_land_on_cpu(make):
    megatron_cpu.apply()
    tensor = make()
    assert tensor.device == torch.device("cpu")
    assert tensor.shape == (3,)


def test_tensor_type_says_cuda_to_megatron_only():
    megatron_cpu.apply()
    ask = "def ask(t):\n    return t.type()\n"
    as_megatron: dict = {"__name__": "megatron.core.optimizer.fake"}
    as_other: dict = {"__name__": "someone.else"}
    exec(ask, as_megatron)
    exec(ask, as_other)
    assert as_megatron["ask"](torch.zeros(1)) == "torch.cuda.FloatTensor"
    assert as_megatron["ask"](torch.zeros(1, dtype=torch.bfloat16)) == "torch.cuda.BFloat16Tensor"
    assert as_other["ask"](torch.zeros(1)) == "torch.FloatTensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversions untouched


def test_rng_tracker_forks_the_cpu_generator():
    megatron_cpu.apply()
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    after = torch.rand(4)
    # Megatron's tensor-parallel stream is seeded with seed + 2718 + tp_rank; the default stream
    # with the seed itself, and the fork leaves it where it was.
    assert torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(123 + 2718 + 1)))
    assert torch.equal(after, torch.rand(4, generator=torch.Generator().manual_seed(123)))


def test_streams_events_and_sync_are_noops():
    megatron_cpu.apply()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(device=torch.cuda.current_device())
    with torch.cuda.stream(stream):
        tensor = torch.ones(2, device="cuda") * 2
    torch.cuda.current_stream().wait_stream(stream)
    tensor.record_stream(stream)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    event.synchronize()
    assert tensor.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("with_mask", [False, True])
def test_sdpa_matches_megatron_dot_product_attention(world, with_mask):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        masked_softmax_fusion=False,
        attention_dropout=0.0,
    )
    common = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, theirs = SDPAttention(**common), DotProductAttention(**common)
    gen = torch.Generator().manual_seed(0)
    sq, b = 7, 2
    q = torch.randn(sq, b, 4, 16, generator=gen)
    k, v = (torch.randn(sq, b, 2, 16, generator=gen) for _ in range(2))
    mask = None
    if with_mask:  # causal, and batch row 1 is left-padded by two positions
        mask = torch.ones(sq, sq, dtype=torch.bool).triu(1).expand(b, 1, sq, sq).clone()
        mask[1, :, :, :2] = True
        mask[1, :, :2, :2] = torch.ones(2, 2, dtype=torch.bool).triu(1)  # padding rows see themselves
    out = ours(q, k, v, mask)
    expected = theirs(q, k, v, mask)
    assert out.shape == (sq, b, 64)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# ---- the training path -------------------------------------------------------------------------

CLIP_GRAD = 0.5
NUM_STEPS = 4


def _build_trainable(distributed_optimizer: bool):
    """A random tiny Qwen3 in megatron DDP with megatron's adam (clipping at CLIP_GRAD)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tensor_parallel.model_parallel_cuda_manual_seed(0)  # same random init in every process
    model = Qwen3(ModelConfig()).build_model()
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=distributed_optimizer,
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, clip_grad=CLIP_GRAD, use_distributed_optimizer=distributed_optimizer
        ),
        [ddp],
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp, optimizer


def _next_token_step(data_iterator, model):
    """megatron forward_step_func: mean next-token cross-entropy of one micro-batch."""
    batch = next(data_iterator)
    positions = torch.arange(batch.shape[1] - 1).expand(batch.shape[0], -1)
    per_token_loss = model(
        input_ids=batch[:, :-1], position_ids=positions, attention_mask=None, labels=batch[:, 1:]
    )

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    return per_token_loss, loss_func


def _train(dp_rank: int, dp_size: int, distributed_optimizer: bool) -> tuple[list[float], list[float]]:
    """NUM_STEPS adam steps of next-token loss on a fixed batch; (losses, grad norms) per step.

    Every data-parallel rank sees its slice of the same 4-sequence batch, so the mean of the
    ranks' losses and the (all-reduced) grad norm must equal the one-rank run's.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp, optimizer = _build_trainable(distributed_optimizer)
    tokens = torch.randint(2, 16, (4, 12), generator=torch.Generator().manual_seed(1))
    tokens = tokens.chunk(dp_size)[dp_rank]
    forward_backward = get_forward_backward_func()
    losses, grad_norms = [], []
    for _ in range(NUM_STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        stats = forward_backward(
            forward_step_func=_next_token_step,
            data_iterator=iter([tokens]),
            model=[ddp],
            num_microbatches=1,
            seq_length=11,
            micro_batch_size=tokens.shape[0],
        )
        update_ok, grad_norm, _ = optimizer.step()
        assert update_ok
        losses.append(stats[0]["loss"].item())
        grad_norms.append(float(grad_norm))
    return losses, grad_norms


def _train_rank(rank: int, world_size: int, port: int, out_dir) -> None:
    torch.set_num_threads(1)
    with megatron_world(rank, world_size, port):
        losses, grad_norms = _train(rank, world_size, distributed_optimizer=True)
    torch.save({"losses": losses, "grad_norms": grad_norms}, out_dir / f"rank{rank}.pt")


def test_megatron_training_stack_trains_on_cpu(world, tmp_path):
    losses, grad_norms = _train(0, 1, distributed_optimizer=False)
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert grad_norms[0] > CLIP_GRAD  # so clipping really scaled the gradients

    spawn_ranks(_train_rank, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    dp_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert dp_losses == pytest.approx(losses, rel=1e-5)
    for rank in ranks:
        assert rank["grad_norms"] == pytest.approx(grad_norms, rel=1e-5)
