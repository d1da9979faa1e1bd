"""The Megatron-core trainer."""

import warnings

# megatron-core warns at import of every module that falls back from Transformer Engine / Apex
# to torch; rlx runs without them on purpose, so the warnings are noise on every rank.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|APEX|full scope is deprecated).*")
# and its buffers' `offload_to_cpu` (a colocated trainer's hand-over) frees them through
# `tensor.storage()`, which torch warns about once a process
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", module="megatron")
