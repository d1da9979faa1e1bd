"""Names SGLang's native HTTP API fixes that both of its sides in rlx use: the client side
(`rlx.rollout`: the pool, the health monitor) and rlx's own server (`rlx.engine.serve`, and the
engine behind it).

One definition, here, rather than one per side: the sides cannot drift apart, and importing it
costs nothing (no torch, no rlx module), so the driver and sglang-router's process never load the
engine to learn a name of the protocol.
"""

# what `/release_memory_occupation` and `/resume_memory_occupation` take in `{"tags": [...]}`
# (sglang 0.5.4's GPU_MEMORY_TYPE_WEIGHTS and GPU_MEMORY_TYPE_KV_CACHE); all of them when absent
MEMORY_TAGS = ("weights", "kv_cache")
