"""megatron's rotary caches let go of a dropped model once megatron is torn down
(`rlx.compat.megatron_caches`, called by `rlx.trainer.parallel.destroy_distributed`)."""

from __future__ import annotations

import gc
import weakref

import torch
from helpers import megatron_world  # tests/ is on sys.path (conftest)

from rlx.compat import megatron_caches
from rlx.models.config import ModelConfig
from rlx.models.qwen3 import Qwen3


def test_a_dropped_models_rotary_module_is_freed_when_megatron_is_torn_down():
    with megatron_world():
        model = Qwen3(ModelConfig()).build_model()
        ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, position_ids=torch.arange(6).expand(2, -1), attention_mask=None)
        rotary = weakref.ref(model.rotary_pos_emb)
        del model
        gc.collect()
        assert rotary() is not None  # megatron's lru_cache on forward holds it (and its angles)
        assert sum(f.cache_info().currsize for f in megatron_caches.cached_forwards()) > 0
    gc.collect()
    assert rotary() is None
    assert sum(f.cache_info().currsize for f in megatron_caches.cached_forwards()) == 0
