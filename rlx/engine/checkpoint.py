"""What an engine reads of a checkpoint before its weights: the transformers config, the
tokenizer and the EOS ids, read as transformers and SGLang read them."""

from __future__ import annotations

from typing import Any


def read_checkpoint(model_path: str, tokenizer_path: str) -> tuple[Any, Any]:
    """(the checkpoint's transformers config, its tokenizer), read as transformers reads them."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    return config, AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)


def load_ahead(model_path: str, tokenizer_path: str | None = None) -> None:
    """What an Engine for `model_path` loads before its weights, loaded and let go: transformers'
    auto classes, the checkpoint's config, tokenizer and generation config (5 s of an engine's
    start on the GPU machine's image, whose transformers imports sklearn and scipy), then the
    engine's runner and kernels. For a process started ahead of its engine, which then sets up
    without those imports (`rlx.rollout`'s early engines). Touches no device."""
    config, tokenizer = read_checkpoint(model_path, tokenizer_path or model_path)
    eos_ids(config, model_path, tokenizer)
    import rlx.engine.model_runner  # noqa: F401  (`Engine._build_runner` imports it)


def eos_ids(config, model_path: str, tokenizer) -> set[int]:
    """EOS ids from the model config, its generation config and the tokenizer, as SGLang gathers them."""
    from transformers import GenerationConfig

    try:
        generation_eos = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    except OSError:
        generation_eos = None
    ids: set[int] = set()
    for value in (getattr(config, "eos_token_id", None), generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(x) for x in value)
    return ids
