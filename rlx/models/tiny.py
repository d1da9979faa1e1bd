"""Tiny random-initialised models written as real HF checkpoint directories.

A tiny model is what the embedded default and the tests train: `config.json`,
`model.safetensors`, and a `tokenizer.json` built with the `tokenizers` library over the tiny
vocabulary below. Everything downstream loads it exactly as it would load a downloaded checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from rlx.cache import cache_dir

PAD = "<pad>"
EOS = "<eos>"
# The tiny models' word-level vocabulary: two special tokens, the digits and a few symbols, so a
# random tiny model can learn a digit task on CPU in minutes.
VOCAB: list[str] = [PAD, EOS, *(str(d) for d in range(10)), "=", "+", "-", "?"]


def write_word_tokenizer(path: Path, vocab: list[str] = VOCAB) -> None:
    """Save a whitespace-split word-level tokenizer (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    fast.save_pretrained(str(path))


def write_tiny_checkpoint(
    hf_config, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Path:
    """Write a random model for `hf_config` (a transformers PretrainedConfig) to `path`.

    Written to a temporary sibling first and renamed, so a crash never leaves half a checkpoint.
    `dtype` and `device` are where the random weights are made and the precision they are saved
    in: a benchmark's model of a real size (billions of parameters) is made on a GPU in bf16 in
    seconds, where fp32 on the CPU takes minutes and twice the disk. The same seed gives other
    weights on another device.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        _fill_zero_embedding_rows(model, std=getattr(hf_config, "initializer_range", 0.02))
        model.save_pretrained(str(staging))
        write_word_tokenizer(staging)
        try:
            staging.rename(path)
        except OSError:  # another process won the race; its checkpoint is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _fill_zero_embedding_rows(model, std: float) -> None:
    """Give the pad token's embedding row (zeroed by transformers' init) random values.

    transformers zeroes the `padding_idx` row and blocks its gradient; Megatron's embedding
    has no padding_idx. A random policy samples <pad>, a zero vector then enters RMSNorm,
    whose gradient there is 1/sqrt(eps) (~1e3), and the first step's gradient norm explodes.
    Real checkpoints have trained, non-zero rows; so do tiny ones.
    """
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        zero_rows = (weight == 0).all(dim=1)
        rows = torch.randn(int(zero_rows.sum()), weight.shape[1], device=weight.device) * std
        weight[zero_rows] = rows.to(weight.dtype)


# Bump when the written weights change for the same config, so caches are rewritten.
_TINY_FORMAT = 2


def tiny_checkpoint_path(name: str, config_key: str) -> Path:
    """Cache path of a tiny model, keyed by its architecture (`ModelFamily.hf_config_key`: the
    config's class, kwargs and transformers' version) so a reshape gets a new directory."""
    keyed = {"rlx_tiny_format": _TINY_FORMAT, "config": config_key}
    digest = hashlib.sha1(json.dumps(keyed, sort_keys=True).encode())
    return cache_dir() / "models" / f"{name}-{digest.hexdigest()[:10]}"
