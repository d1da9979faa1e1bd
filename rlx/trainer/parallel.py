"""Process-group and megatron parallel-state set-up for one trainer rank, on CPU or GPU."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from rlx.ports import held_store, pin_collectives, tcp_store

TIMEOUT = datetime.timedelta(minutes=10)  # the rendezvous and every collective of the default group


def rendezvous_store(host: str) -> dist.TCPStore:
    """The rendezvous store rank 0 hosts, on a port it holds (`rlx.ports.held_store`)."""
    return held_store(host, TIMEOUT.total_seconds())


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    tp: int = 1,
    pp: int = 1,
    seed: int = 0,
    ep: int = 1,
    vp: int | None = None,
    cp: int = 1,
    store: dist.Store | None = None,
) -> torch.device:
    """Join the default process group and initialise megatron's parallel state and RNG.

    The boundary module (`rlx.compat.megatron_cpu`) is applied first: in full without a GPU (the
    group then uses gloo); with one, only its fixes for megatron without Transformer Engine, and
    the rank takes GPU `LOCAL_RANK` (else `rank % device_count`) and NCCL.
    Data parallelism is what is left of `world_size` after `tp * pp * cp`; context parallelism
    (`cp`) splits each sequence over ranks (`rlx.trainer.context`). Expert parallelism (`ep`)
    splits MoE experts over ranks; experts keep the dense TP size, so `tp * ep * pp` must divide
    `world_size` (megatron's rule). `vp`: virtual pipeline stages per rank (megatron's interleaved
    schedule), None for none. `store`: the rendezvous store this rank already hosts
    (`rendezvous_store`); without one, rank 0 hosts it at `master_addr:master_port` and the
    others join it there. Returns the device that this rank's tensors live on.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlx.compat import megatron_cpu

    if world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp*cp={tp}*{pp}*{cp}")
    if world_size % (tp * ep * pp) != 0:
        raise ValueError(f"world_size={world_size} is not divisible by tp*ep*pp={tp}*{ep}*{pp}")
    # On a GPU this applies only the fixes for megatron without Transformer Engine (MoE, MLA).
    on_cpu = megatron_cpu.apply()
    if not on_cpu:
        local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        pin_collectives(master_addr)  # one node: gloo and NCCL on loopback
        if store is None:  # rank 0 hosts at master_port (the old way), the others join it
            store = tcp_store(master_addr, master_port, is_master=rank == 0, world_size=world_size,
                              timeout_s=TIMEOUT.total_seconds())  # fmt: skip
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vp,
    )
    # Seeds the tensor-parallel RNG tracker too; on CPU this is the CPU generator (see boundary).
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return device


def destroy_distributed() -> None:
    """Tear down megatron's parallel state and the default process group (safe to call twice),
    forget the groups megatron's teardown leaves named (`rlx.compat.megatron_teardown`), and
    empty megatron's rotary caches, which would keep the dropped models' angle tensors
    (`rlx.compat.megatron_caches`)."""
    from megatron.core import parallel_state

    from rlx.compat import megatron_caches, megatron_teardown

    parallel_state.destroy_model_parallel()
    megatron_teardown.forget_groups()
    megatron_caches.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
