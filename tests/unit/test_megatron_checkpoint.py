"""A synchronous distributed checkpoint starts no multiprocessing manager (`rlx.compat.megatron_checkpoint`):
the save writes and loads back as megatron's own does, no process is left behind, and megatron's
queue for asynchronous saves is as it was."""

from __future__ import annotations

import psutil
import torch
from helpers import megatron_world  # tests/ is on sys.path (conftest)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from rlx.compat import megatron_checkpoint
from rlx.models.config import ModelConfig
from rlx.models.qwen3 import Qwen3


def test_a_save_round_trips_and_starts_no_manager_process(tmp_path):
    with megatron_world():
        torch.manual_seed(0)
        model = Qwen3(ModelConfig()).build_model()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        previous = filesystem_async._results_queue
        (tmp_path / "ckpt").mkdir()
        with megatron_checkpoint.in_process_results():
            dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "ckpt"))
        assert filesystem_async._results_queue is previous
        left = [
            p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
        ]
        assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in left]

        torch.manual_seed(1)
        other = Qwen3(ModelConfig()).build_model()
        assert not torch.equal(other.embedding.word_embeddings.weight, model.embedding.word_embeddings.weight)
        other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), str(tmp_path / "ckpt")))
        for (name, saved), (_, loaded) in zip(
            model.state_dict().items(), other.state_dict().items(), strict=True
        ):
            if isinstance(saved, torch.Tensor):
                assert torch.equal(saved, loaded), name
