"""Export a run's Megatron checkpoint as an HF directory that transformers (and SGLang) load.

    python -m rlx.tools.export outputs/DATE/TIME                  # latest checkpoint -> RUN/hf_export
    python -m rlx.tools.export outputs/DATE/TIME --step 9 --out /path/to/hf
    python -m rlx.tools.export outputs/DATE/TIME --adapter        # a LoRA run's adapters, PEFT format

A LoRA run's checkpoint holds its adapters only: they are put back on the base model it trained
from (`model.checkpoint`) and exported merged, or with `--adapter` as a PEFT directory.

The checkpoint may have been written under any tensor/pipeline layout: this process loads it
as one rank (Megatron's distributed checkpointing reshards), so it needs the memory of one
model copy, not of its optimizer.

A checkpoint is code: loading it unpickles its metadata (`rlx.checkpoint`), and the run's
config.yaml names the classes built (`_target_`). Export only run directories your own runs wrote;
one without rlx's run record (config.yaml and run_info.json) is refused before anything is read.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from omegaconf import OmegaConf

from rlx import checkpoint
from rlx.config import build
from rlx.config.compose import to_object
from rlx.config.schema import RlxConfig
from rlx.errors import ConfigError
from rlx.lora.adapter import is_adapter_key
from rlx.lora.apply import apply_lora
from rlx.lora.peft import peft_tensors, unsupported, write_peft
from rlx.ports import LOOPBACK
from rlx.trainer.weights import write_weight_shards


def export(
    run_dir: str | Path, step: int | None = None, out: str | Path | None = None, adapter: bool = False
) -> Path:
    """Write the policy of `run_dir`'s checkpoint (latest, or `step`) as an HF directory, or with
    `adapter` (a LoRA run) its adapters as a PEFT directory; return it."""
    from megatron.core import dist_checkpointing

    from rlx.trainer.parallel import destroy_distributed, init_distributed, rendezvous_store

    run_dir = Path(run_dir).resolve()
    # before anything of it is read: config.yaml names classes to build, the checkpoint is unpickled
    checkpoint.check_written_by_rlx(run_dir, f"python -m rlx.tools.export {run_dir}")
    ckpt = checkpoint.step_dir(run_dir, step) if step is not None else checkpoint.find_latest(str(run_dir))
    if not (ckpt / "megatron").is_dir():
        raise ConfigError(
            f"no checkpoint at {ckpt}; the run's checkpoints are under {run_dir / 'checkpoints'}"
        )
    recorded = OmegaConf.load(run_dir / "config.yaml")
    recorded.pop("defaults", None)  # the Hydra defaults list that makes config.yaml rerunnable
    rc = to_object(OmegaConf.merge(OmegaConf.structured(RlxConfig), recorded))
    lora = rc.train.lora if rc.train.lora.enabled else None
    if adapter and lora is None:
        raise ConfigError(
            f"--adapter: {run_dir} trained every weight (train.lora.rank unset): it has no adapters"
        )
    if adapter and (reason := unsupported(rc.model, lora)):
        raise ConfigError(f"--adapter: no PEFT export: {reason}")
    out = Path(out) if out else run_dir / ("hf_adapter_export" if adapter else "hf_export")

    family = build(rc.model)
    store = rendezvous_store(LOOPBACK)  # a port it holds: none found free, then taken before the bind
    init_distributed(0, 1, LOOPBACK, store.port, store=store)
    try:
        model = family.build_model()
        state = model.sharded_state_dict()
        if lora is not None:  # the base from its HF directory, the adapters from the checkpoint
            family.load_hf_weights(model, family.checkpoint_dir())
            apply_lora(model, lora, rc.run.seed)
            state = {k: v for k, v in model.sharded_state_dict().items() if is_adapter_key(k)}
        state = dist_checkpointing.load({"model": state}, str(ckpt / "megatron"))
        model.load_state_dict(state["model"], strict=lora is None)
        if adapter:
            tensors = peft_tensors(family.weight_bridge(), model, None, 1)
            write_peft(tensors, out, asdict(lora), family.checkpoint_dir())
        else:
            write_weight_shards(family.export_hf_weights(model), out, bucket_bytes=4 << 30)
            checkpoint.copy_hf_side_files(family.checkpoint_dir(), out)
    finally:
        destroy_distributed()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlx.tools.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (Hydra's outputs/DATE/TIME) with checkpoints/")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/hf_export)")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run: its adapters in PEFT's format")
    args = parser.parse_args(argv)
    try:
        print(export(args.run_dir, args.step, args.out, args.adapter))
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
