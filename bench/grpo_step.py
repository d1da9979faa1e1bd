"""One full GRPO step on GPUs, phase by phase: rollout, old log-probs, train, weight sync.

    python bench/grpo_step.py --shape 0.6b                      # 1 GPU, colocated (cluster=1gpu)
    python bench/grpo_step.py --shape 1.7b
    python bench/grpo_step.py --shape 1.7b --split              # 2 GPUs: 1 trainer + 1 engine, NCCL sync
    python bench/grpo_step.py --shape 0.6b -- rollout.weight_sync=disk   # any config override after --
    python bench/grpo_step.py --shape 1.7b --output-dir prof -- debug.profile_train_steps=[2]
    python bench/grpo_step.py --model ~/.cache/rlx/SmolLM2-135M-Instruct \
        --prompt-file ~/.cache/rlx/arithmetic/train.jsonl --prompts 64 --response-len 96 --micro-batch 128
    # issue 28's runs, on random weights of a shipped model option's shape (--layers cuts it):
    python bench/grpo_step.py --option glm4_9b --gpus 4 --tp 2 --response-len 1024 --micro-batch 2
    python bench/grpo_step.py --option glm4_9b --split 2+2 --tp 2 --response-len 1024 --micro-batch 2
    python bench/grpo_step.py --option qwen3_30b_a3b --layers 18 --gpus 4 --ep 4 --micro-batch 2
    python bench/grpo_step.py --option glm4_9b --gpus 4 --tp 2 --plan-only   # the memory plan alone, no GPU

A random-weight Qwen3 of the stated shape (written once as an HF checkpoint under RLX_CACHE, in
bf16 on the GPU), or
a real checkpoint by path (`--model`; its family and shape from config.json), bf16 training, `--prompts` prompts x `--n` samples of exactly `--response-len` tokens
(`rollout.ignore_eos`; the prompts are the toy task's few tokens), micro-batches of
`--micro-batch` samples (default: the largest the memory plan fits on this machine's GPUs,
colocated with the trainer's state kept; `choose_micro_batch`). Runs `--steps` steps and
reports the median of all but the first (CUDA graph capture, kernel compilation, allocator
warm-up), as one JSON line: seconds per phase, tokens/s per GPU counted both ways (NeMo-RL's:
prompt + response tokens of the step / step time / GPUs; and response tokens alone), the trainer's peak memory and, colocated, the memory
each side leaves behind. Beside the measured peak (`trainer_peak_mem_gib`, rank 0's
torch.cuda.max_memory_allocated) stands the memory plan's prediction of it (`predicted_trainer_peak_gib`,
rlx.memory) and their ratio: the plan's goal is within 15%. Record the figures with machine and date in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

SHAPES = {  # Qwen3-0.6B / Qwen3-1.7B shapes (published config.json values)
    "0.6b": dict(hidden_size=1024, ffn_hidden_size=3072, num_layers=28),
    "1.7b": dict(hidden_size=2048, ffn_hidden_size=6144, num_layers=28),
}
COMMON = dict(num_attention_heads=16, num_query_groups=8, kv_channels=128, vocab_size=151936,
              max_position_embeddings=40960, rotary_base=1000000.0, tie_word_embeddings=True)  # fmt: skip
PHASES = ("time/rollout_s", "time/logprobs_s", "time/train_s", "time/weight_sync_s", "time/step_s",
          # colocated: the hand-overs (engines release + trainer onloads; the weight sync within the
          # second, with the engines' weights resumed before it and the trainer's offload after it);
          # absent where nothing is released (cluster.release_memory: the weight sync alone)
          "time/colocate_to_trainer_s", "time/colocate_to_engines_s",
          # their parts (rlx.colocation): engines release, trainer onload / trainer offloads all but
          # its weights, engines resume their weights, (weight sync), trainer offloads its weights,
          # engines resume their KV cache
          "time/colocate/engines_release_s", "time/colocate/trainer_onload_s",
          # within the trainer's onload: on its rank (the rest is the call), its gradient buffers
          "time/colocate/trainer_onload_on_rank_s", "time/colocate/trainer_onload_grad_buffers_s",
          "time/colocate/trainer_offload_state_s", "time/colocate/engines_resume_weights_s",
          "time/colocate/trainer_offload_s",
          "time/colocate/engines_resume_kv_cache_s")  # fmt: skip


def gpu_counts(args: argparse.Namespace) -> tuple[int, int, bool]:
    """(trainer GPUs, engine GPUs, colocated) of `--gpus` / `--split`."""
    if args.split:
        trainer, _, engines = args.split.partition("+")
        return int(trainer), int(engines or trainer), False
    return args.gpus, args.gpus, True


def model_overrides(args: argparse.Namespace) -> list[str]:
    if args.model:
        return [f"model.hf_checkpoint={args.model}"]  # family and shape from its config.json
    if args.option:  # a shipped option's shape, random weights written once (like the tiny models)
        layers = [f"model.num_layers={args.layers}"] if args.layers else []
        name = f"bench_{args.option}" + (f"_{args.layers}l" if args.layers else "")
        return [f"model={args.option}", "model.tiny=true", f"model.name={name}", *layers,
                "+rollout.engine_args.dtype=bfloat16"]  # fmt: skip
    shape = {f"model.{k}": v for k, v in (SHAPES[args.shape] | COMMON).items()}
    return [f"model.name=bench_qwen3_{args.shape}", *(f"{k}={v}" for k, v in shape.items()),
            "+rollout.engine_args.dtype=bfloat16"]  # a random checkpoint written on the CPU is fp32  # fmt: skip


def overrides_for(args: argparse.Namespace) -> list[str]:
    model = model_overrides(args)
    # the toy task's prompts are a few tokens: bound them, so packing budgets and the memory plan
    # count samples of prompt + response rather than of the whole context
    data = (
        ["data=math", f"data.prompt_path={args.prompt_file}"]
        if args.prompt_file
        else ["data.max_prompt_len=64"]
    )
    trainer_gpus, engine_gpus, colocated = gpu_counts(args)
    if colocated and trainer_gpus == 1:
        placement = ["cluster=1gpu"]
    else:
        placement = [f"cluster.gpus_per_node={trainer_gpus if colocated else trainer_gpus + engine_gpus}",
                     f"cluster.num_trainer_procs={trainer_gpus}", f"cluster.num_rollout_gpus={engine_gpus}",
                     f"cluster.colocate={str(colocated).lower()}", f"rollout.num_engines={engine_gpus}"]  # fmt: skip
    parallel = [f"cluster.{key}_parallel_size={size}" for key, size in
                (("tensor", args.tp), ("expert", args.ep), ("context", args.cp)) if size > 1]  # fmt: skip
    if trainer_gpus > args.tp * args.cp:  # data-parallel ranks share the optimizer state
        parallel.append("train.distributed_optimizer=true")
    batch = args.prompts * args.n
    return [
        *model, *data, *placement, *parallel, "train.precision=bf16", f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={batch}",
        f"rollout.batch_size={args.prompts}", f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_response_len={args.response_len}", "rollout.ignore_eos=true", "rollout.temperature=1.0",
        f"run.num_rollout={args.steps}", "run.progress=false", "run.loggers=[jsonl]", "run.dump_rollouts=false",
    ]  # fmt: skip


FALLBACK_MICRO_BATCH = 8  # --micro-batch where the plan sees no GPU (--plan-only on a CPU machine)
MAX_MICRO_BATCH = 32  # the plan may fit more on an H200 (64 at the 1.7B shape); 32 keeps runs comparable


def choose_micro_batch(args: argparse.Namespace, extra: list[str]) -> tuple[int, str]:
    """The largest micro-batch, at most MAX_MICRO_BATCH, whose memory plan fits this machine's GPUs
    with `cluster.memory_margin` free, colocated with the trainer's state kept on the GPU where
    `auto` keeps it (`rlx.config.memory_check.roomier_micro_batch`, from 1 up); fewer, longer
    micro-batches spend less host time a step. Returns the size and why."""
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import gpu_memory, no_plan, roomier_micro_batch

    one = argparse.Namespace(**vars(args) | {"micro_batch": 1})
    rc = to_object(compose(["run.output_dir=/tmp/grpo_step_plan", *overrides_for(one), *extra]))
    if no_plan(rc) or gpu_memory(rc)[0] is None:
        return FALLBACK_MICRO_BATCH, "no GPU seen by the memory plan"
    size = (roomier_micro_batch(rc) or (1,))[0]
    why = "the largest the memory plan fits (the trainer's state where auto puts it)"
    return min(size, MAX_MICRO_BATCH), why


def predicted_peak_gib(cfg, mean_prompt_len: float) -> float:
    """The memory plan's trainer peak (rank 0's torch.cuda.max_memory_allocated, in GiB) for the
    composed `cfg`, its samples counted with prompts of the batch's mean length (the plan's own
    default, data.max_prompt_len unset, counts none)."""
    from dataclasses import replace

    from rlx.config.compose import to_object
    from rlx.config.memory_check import memory_setup
    from rlx.memory import GIB, trainer_peak_allocated

    setup = memory_setup(to_object(cfg))
    return trainer_peak_allocated(replace(setup, prompt_len=round(mean_prompt_len))) / GIB


def _write_random_checkpoint(model_cfg) -> None:
    """Write the run's random checkpoint on the GPU in bf16 (`rlx.models.tiny`): a 9B or 13B
    model in seconds, where the CPU's fp32 takes minutes and twice the disk. Runs in a process of
    its own, so its CUDA context is gone before the run measures memory."""
    import torch

    from rlx.config.build import build

    build(model_cfg).checkpoint_dir(dtype=torch.bfloat16, device="cuda")


def prewrite_random_checkpoint(cfg) -> float:
    """Seconds spent writing `--option`'s random checkpoint on GPU 0 (0 when it is cached)."""
    import multiprocessing

    from rlx.config.compose import to_object

    start = time.perf_counter()
    process = multiprocessing.get_context("spawn").Process(
        target=_write_random_checkpoint, args=(to_object(cfg).model,)
    )
    process.start()
    process.join()
    if process.exitcode != 0:
        raise SystemExit(
            f"error: writing the random {cfg.model.name} checkpoint failed (exit {process.exitcode})"
        )
    return time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--model", help="an HF checkpoint directory instead of a random --shape")
    parser.add_argument("--prompt-file", help="prompts of a file (data=math) instead of the toy task's")
    parser.add_argument("--option", help="a shipped model option (conf/model) as the shape, e.g. glm4_9b")
    parser.add_argument("--layers", type=int, help="with --option: cut the model to this many layers")
    parser.add_argument("--gpus", type=int, default=1, help="colocated on this many GPUs (one engine each)")
    parser.add_argument(
        "--split",
        nargs="?",
        const="1+1",
        help="T+E: trainer on T GPUs, one engine on each of E more (NCCL sync); alone: 1+1",
    )
    parser.add_argument("--tp", type=int, default=1, help="the trainer's tensor parallel size")
    parser.add_argument("--ep", type=int, default=1, help="the trainer's expert parallel size")
    parser.add_argument("--cp", type=int, default=1, help="the trainer's context parallel size")
    parser.add_argument("--plan-only", action="store_true", help="print the memory plan and exit (no GPU)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument(
        "--micro-batch",
        type=int,
        help=f"default: the largest (at most {MAX_MICRO_BATCH}) that the memory plan fits on this machine's GPUs "
        "(colocated: with the trainer's state kept on the GPU, as cluster.offload_trainer=auto decides); "
        f"{FALLBACK_MICRO_BATCH} where no GPU is seen",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", help="keep the run directory here (default: a temporary one)")
    return parser


def main(argv: list[str]) -> None:
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    why_micro_batch = "--micro-batch"
    if args.micro_batch is None:
        args.micro_batch, why_micro_batch = choose_micro_batch(args, extra)
        print(f"micro-batch {args.micro_batch}: {why_micro_batch}", file=sys.stderr, flush=True)
    if args.plan_only:
        from rlx.config.compose import compose, to_object
        from rlx.config.memory_check import print_plan
        from rlx.config.validate import run_max_prompt_len
        from rlx.errors import ConfigError

        try:
            rc = to_object(compose(["run.output_dir=/tmp/grpo_step_plan", *overrides_for(args), *extra]))
            print_plan(rc, run_max_prompt_len(rc))
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        return

    import torch

    from rlx.config.compose import compose
    from rlx.runtime import run

    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or tmp
        start = time.perf_counter()
        cfg = compose([f"run.output_dir={out}", *overrides_for(args), *extra])
        write_s = prewrite_random_checkpoint(cfg) if not args.model and torch.cuda.is_available() else 0.0
        history = run(cfg)
        wall = time.perf_counter() - start
    timed = history[1:] or history
    median = lambda key: statistics.median(h[key] for h in timed if key in h)  # noqa: E731
    trainer_gpus, engine_gpus, colocated = gpu_counts(args)
    num_gpus = trainer_gpus if colocated else trainer_gpus + engine_gpus
    tokens, prompt_tokens = median("rollout/num_tokens"), median("rollout/num_prompt_tokens")
    result = {
        "bench": "grpo_step", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "shape": args.model or args.option or args.shape, "layers": args.layers,
        "placement": "colocated" if colocated else f"split {trainer_gpus}+{engine_gpus}", "gpus": num_gpus,
        "tp": args.tp, "ep": args.ep, "cp": args.cp,
        "samples": args.prompts * args.n, "response_len": args.response_len, "steps": len(history),
        "micro_batch": args.micro_batch, "micro_batch_from": why_micro_batch,
        "wall_s": round(wall, 1), "checkpoint_write_s": round(write_s, 1),
        # time/logprobs_s: absent where the old log-probs came from the training pass (train.old_logprobs);
        # time/colocate_*: absent when split
        **{k.split("/", 1)[1].replace("/", "_"): round(median(k), 3) for k in PHASES if k in timed[-1]},
        "tokens_per_s_per_gpu": round((tokens + prompt_tokens) / median("time/step_s") / num_gpus),
        "response_tokens_per_s_per_gpu": round(tokens / median("time/step_s") / num_gpus),
        "rollout_tokens_per_s": round(median("perf/rollout_tokens_per_s")),
        "trainer_peak_mem_gib": round(median("perf/trainer_peak_mem_gib"), 2),
        # the memory plan's prediction of that figure (rlx.memory; the goal: within 15%)
        "predicted_trainer_peak_gib": round(predicted_peak_gib(cfg, prompt_tokens / (args.prompts * args.n)), 2),
        "overrides": extra,
    }  # fmt: skip
    result["predicted_over_measured"] = round(
        result["predicted_trainer_peak_gib"] / result["trainer_peak_mem_gib"], 3
    )
    if "perf/gpu_used_gib" in timed[-1]:  # the device as training ends, every process (rank 0's GPU)
        result["gpu_used_gib"] = round(median("perf/gpu_used_gib"), 2)
    for key in ("colocate/trainer_offloaded_process_reserved_gib", "colocate/before_onload_device_used_gib"):
        if key in timed[-1]:
            result[key.split("/")[1]] = round(median(key), 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
