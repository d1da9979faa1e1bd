"""The memory plan as text: one small table per GPU kind, each term named, in GiB.

    memory plan: glm4_9b (9.40B parameters), bf16, distributed optimizer, TP=2 PP=1 CP=1 EP=1 DP=2, colocated, ...
    GPU memory: 79.6 GiB (cluster.gpu_memory_gib=79.6)
    colocated GPU (trainer rank + engine) x 4                                     GiB
      training                                                                   60.1
        policy weights (bf16, 4.70B parameters)                                   8.8
        ...
      peak 71.2 GiB while generating: 8.4 GiB (11%) to spare

A GPU's training and generating phases are printed in full (colocated: both, each with what the
other side leaves behind), and its peak phase if another; any other phase as one line, its total.
"""

from __future__ import annotations

from rlx.memory.terms import Phase, Plan, Role, gib

WIDTH = 70  # the name column


def report(plan: Plan) -> str:
    """`plan` as the lines `run.plan_only=true` prints and every GPU run logs first."""
    lines = [f"memory plan: {plan.headline}"]
    if plan.gpu_bytes is None:
        lines.append(
            "GPU memory: unknown (no GPU seen here); set cluster.gpu_memory_gib to check the plan against it"
        )
    else:
        lines.append(f"GPU memory: {gib(plan.gpu_bytes)} GiB ({plan.gpu_source})")
    for role in plan.roles:
        lines += role_lines(role, plan.gpu_bytes)
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def role_lines(role: Role, gpu_bytes: int | None) -> list[str]:
    lines = [f"{f'{role.name} x {role.num_gpus}':<{WIDTH + 4}} {'GiB':>6}"]
    peak = role.peak
    full = {peak.name, "training", "generating"}
    for phase in role.phases:
        lines += phase_lines(phase) if phase.name in full else [_row(f"  {phase.name}", phase.bytes)]
    lines.append(f"  peak {gib(peak.bytes)} GiB ({peak.name}){_margin(peak, gpu_bytes)}")
    return lines


def phase_lines(phase: Phase) -> list[str]:
    return [_row(f"  {phase.name}", phase.bytes)] + [_row(f"    {t.name}", t.bytes) for t in phase.terms]


def _row(name: str, num_bytes: int) -> str:
    if len(name) > WIDTH + 4:
        name = name[: WIDTH + 1] + "..."
    return f"{name:<{WIDTH + 4}} {gib(num_bytes):>6}"


def _margin(peak: Phase, gpu_bytes: int | None) -> str:
    if gpu_bytes is None:
        return ""
    spare = gpu_bytes - peak.bytes
    if spare < 0:
        return f": OVER the GPU's {gib(gpu_bytes)} GiB by {gib(-spare)} GiB"
    return f": {gib(spare)} GiB ({spare / gpu_bytes:.0%}) to spare"
