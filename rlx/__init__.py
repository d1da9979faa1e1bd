"""rlx: reinforcement-learning post-training for large language models."""

from rlx.compat import megatron_jit

__version__ = "0.1.0"

# before any rlx module imports megatron: its torch.compile'd helpers stay plain functions on a
# machine without CUDA (rlx/compat/megatron_jit.py says why)
megatron_jit.install()
