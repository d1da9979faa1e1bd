"""The memory plan: each GPU's predicted peak, from the composed config, before anything starts.

    python launch.py cluster=1x8 model=... run.plan_only=true     # print the plan, start nothing

One job per module, each importing only config schemas and the model families' counts (no
megatron, no Ray):

- `terms`: the vocabulary (`Setup`: what the plan reads; `Term`, `Phase`, `Role`, `Plan`);
- `params`: how many parameters a trainer rank or an engine GPU holds, split from
  `ModelFamily.num_parameters()`;
- `activations`: a layer's activations per micro-batch (Korthikanti et al.'s method, recounted
  for rlx's layer: RMSNorm, SwiGLU, GQA, SDPA attention);
- `trainer`: weights, fp32 gradient buffer, optimizer state (sharded or not), reference model,
  critic, activations of the micro-batches in flight, logits;
- `engine`: weights, KV cache from `mem_fraction_static`, CUDA graphs, workspace;
- `plan`: the roles (trainer, engine, colocated GPU) and their phases; the refusal and its advice;
- `report`: the printed tables; `gpus`: this machine's GPU memory, from nvidia-smi;
- `host`: a CPU run's processes in the machine's memory (calibrated on a CPU; refuses what cannot fit).

What is approximate is said where it is computed; the goal is within 15% of the measured peak
(`bench/grpo_step.py` prints the prediction beside `perf/trainer_peak_mem_gib`).
"""

from rlx.memory.plan import memory_errors, plan_memory, trainer_peak_allocated
from rlx.memory.report import report
from rlx.memory.terms import GIB, Plan, Setup

__all__ = ["GIB", "Plan", "Setup", "memory_errors", "plan_memory", "report", "trainer_peak_allocated"]
