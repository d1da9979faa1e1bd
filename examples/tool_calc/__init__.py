"""A multi-turn task with a tool: a tiny model learns to call a sandboxed calculator and copy
its answer (two 3-digit numbers added or subtracted), with GRPO on CPU.

    python launch.py +experiment=tool_calc          # tiny Qwen3, CPU, a few minutes
    python launch.py +experiment=tool_calc_gpu      # a 0.2B Qwen3 (16 x 1024) on one GPU, bf16

data.py: the prompts (`CalcSource`); generate.py: the generate_fn (model turn, calculator in
rlx.agent.Sandbox, model turn); calculator.py: the tool; reward.py: the reward. docs/tasks.md,
"Multi-turn and tools", explains the design and records the learning curve.
"""
