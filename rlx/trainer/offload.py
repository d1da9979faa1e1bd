"""Handing a colocated GPU to the rollout engines: a trainable model's parameters, gradient
buffers and optimizer state moved to pinned CPU memory and back.

Megatron's RL helpers do the buffers and the optimizer (`_ParamAndGradBuffer.offload_to_cpu`,
`MegatronOptimizer.offload_to_cpu`); parameters outside a DDP parameter buffer (every one,
unless the distributed optimizer is on) are swapped here, each into a pinned CPU tensor kept for
the next round, so offloading allocates host memory once. On a CPU device everything is a no-op.
"""

from __future__ import annotations

import torch


class Offloader:
    """Moves one model (megatron DDP, or a bare module) and its optimizer off the GPU and back."""

    def __init__(self, model: torch.nn.Module, optimizer=None):
        self.model, self.optimizer = model, optimizer
        self._host: dict[int, torch.Tensor] = {}  # id(param) -> its pinned CPU home
        self.offloaded = False

    def _buffers(self) -> list:
        return list(getattr(self.model, "buffers", [])) + list(
            getattr(self.model, "expert_parallel_buffers", [])
        )

    def _loose_params(self) -> list[torch.nn.Parameter]:
        """Parameters whose storage is their own (not a view into a DDP parameter buffer)."""
        in_buffers = {id(p) for b in self._buffers() if b.param_data is not None for p in b.params}
        return [p for p in self.model.parameters() if id(p) not in in_buffers]

    def offload(self) -> None:
        if self.offloaded or not _on_cuda(self.model):
            return
        torch.cuda.synchronize()
        # the model's own parameters first, into pinned memory; the optimizer then moves only what
        # is its own (fp32 master copies under bf16, and the Adam state)
        for p in self._loose_params():
            if p.data.is_cuda:
                host = self._host.get(id(p))
                if host is None:
                    host = self._host[id(p)] = torch.empty_like(p.data, device="cpu").pin_memory()
                host.copy_(p.data)
                p.data = host
        for buffer in self._buffers():
            buffer.offload_to_cpu(move_params=buffer.param_data is not None, move_grads=True)
        if self.optimizer is not None:
            self.optimizer.offload_to_cpu()
        torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self, device: torch.device) -> None:
        if not self.offloaded:
            return
        for p in self._loose_params():
            if not p.data.is_cuda:
                p.data = p.data.to(device, non_blocking=True)
        for buffer in self._buffers():
            buffer.reload_from_cpu(move_params=buffer.param_data is not None, move_grads=True)
        if self.optimizer is not None:
            self.optimizer.restore_from_cpu()
        torch.cuda.synchronize()
        self.offloaded = False


def _on_cuda(model: torch.nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


def gpu_memory_gib() -> dict[str, float]:
    """This process's reserved GPU memory and the whole device's use (every process), in GiB."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "process_reserved_gib": torch.cuda.memory_reserved() / 2**30,
        "device_used_gib": (total - free) / 2**30,
    }
