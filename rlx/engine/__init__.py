"""rlx's rollout engine: continuous batching over a paged KV cache, CUDA or CPU, one code path.

Split one job per module, as nano-vllm splits its engine:

- `config`: `EngineArgs`, with SGLang's server argument names;
- `sequence`: request, sampling parameters and per-request state;
- `block_manager`: fixed-size KV blocks, reference counts, prefix sharing;
- `checkpoint`: the config, tokenizer and EOS ids, read before the weights;
- `kv_cache`: the cache tensors, sized from `mem_fraction_static`, released and restored;
- `memory_saver`: device memory given back and mapped again at the same addresses (CUDA
  virtual memory), so that a colocated engine's decode CUDA graphs survive a release;
- `scheduler`: which requests run this step under the token budget; preemption;
- `attention`: paged attention (gather + SDPA everywhere, a Triton decode kernel on CUDA);
- `sampler`: temperature / top-k / top-p / min-p / seeds and logprobs on the device;
- `model_runner`: step inputs, eager forward, decode CUDA graphs;
- `models/`: compact forward passes for qwen3, llama, glm4, qwen3_moe over HF weights;
- `engine`: the step loop, add / abort, weight loading, memory release and resume;
- `local`: `LocalEngine`, the engine built from SGLang's server-argument names;
- `serve/`: the engine behind SGLang's native HTTP API (`python -m rlx.engine.serve`, or
  `start_server` in-process): the rest of rlx reaches the engine through it, over HTTP.
"""

from rlx.engine.config import EngineArgs
from rlx.engine.engine import Engine
from rlx.engine.sequence import GenerateOutput, GenerateRequest, SamplingParams, abort_reason

__all__ = ["Engine", "EngineArgs", "GenerateOutput", "GenerateRequest", "SamplingParams", "abort_reason"]
