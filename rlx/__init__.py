"""rlx: reinforcement-learning post-training for large language models."""

from rlx.compat import megatron_jit, megatron_logging

__version__ = "0.1.0"

# before any rlx module imports megatron: its torch.compile'd helpers stay plain functions on a
# machine without CUDA (rlx/compat/megatron_jit.py says why)
megatron_jit.install()
# megatron-FSDP's INFO lines on import (rlx/compat/megatron_logging.py)
megatron_logging.quiet_import_chatter()
