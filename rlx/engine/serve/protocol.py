"""SGLang's /generate JSON (and its other bodies) as rlx's engine server reads and writes them.

`parse_generate` / `build_response` are SGLang's GenerateReqInput and its response as sglang 0.5.4
shapes them (`sglang/srt/managers/io_struct.py`, `tokenizer_manager.py::_handle_batch_output`,
`detokenizer_manager.py::trim_matched_stop`); `parse_sampling_params` maps SGLang's sampling
parameters to the engine's, refusing what the engine cannot honour.
"""

from __future__ import annotations

import uuid
from typing import Any

from rlx.engine.local import LocalEngine
from rlx.engine.sequence import GenerateOutput, GenerateRequest, SamplingParams

# SGLang sampling keys the local engine honours only at their default (no-op) values.
_NOOP_SAMPLING = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
}
_IGNORED_SAMPLING = {"spaces_between_special_tokens", "custom_params", "stream_interval"}


def parse_sampling_params(params: dict[str, Any] | None) -> SamplingParams:
    """SGLang's `sampling_params` JSON -> SamplingParams; ValueError for what the local engine can't honour."""
    params = dict(params or {})
    for key, default in _NOOP_SAMPLING.items():
        if params.pop(key, default) not in (default, None):
            raise ValueError(f"sampling param {key!r} is not supported by the local engine")
    for key in _IGNORED_SAMPLING:
        params.pop(key, None)
    unknown = set(params) - set(SamplingParams.__slots__)
    if unknown:
        raise ValueError(f"unknown sampling params: {sorted(unknown)}")
    params = {k: v for k, v in params.items() if v is not None}
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    sampling = SamplingParams(**params)
    sampling.verify()
    return sampling


def _per_item(value: Any, num: int, name: str, is_list=lambda v: isinstance(v, list)) -> list[Any]:
    """SGLang's batch normalisation: one value for all items, or one per item."""
    if is_list(value):
        if len(value) != num:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {num}")
        return list(value)
    return [value] * num


def parse_generate(body: dict[str, Any], engine: LocalEngine) -> tuple[list[dict[str, Any]], bool]:
    """SGLang's GenerateReqInput (single or batch) -> one dict per prompt, and whether it was single."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("Either text or input_ids should be provided.")
    if text is not None:
        single = isinstance(text, str)
        prompts = [engine.tokenizer.encode(t) for t in ([text] if single else text)]
    else:
        single = not input_ids or not isinstance(input_ids[0], list)
        prompts = [input_ids] if single else input_ids
    num = len(prompts)
    rids = body.get("rid")
    if rids is None:
        rids = uuid.uuid4().hex if single else [uuid.uuid4().hex for _ in range(num)]
    elif single != isinstance(rids, str):
        raise ValueError("The rid should be a string for a single request and a list for a batch.")
    items = []
    for prompt, rid, sampling, logprob, start, top, ids_logprob in zip(
        prompts,
        [rids] if single else rids,
        _per_item(body.get("sampling_params"), num, "sampling_params"),
        _per_item(body.get("return_logprob") or False, num, "return_logprob"),
        _per_item(body.get("logprob_start_len", -1), num, "logprob_start_len"),
        _per_item(body.get("top_logprobs_num") or 0, num, "top_logprobs_num"),
        _per_item(
            body.get("token_ids_logprob"),
            num,
            "token_ids_logprob",
            lambda v: isinstance(v, list) and bool(v) and isinstance(v[0], list),
        ),
        strict=True,
    ):
        if top or ids_logprob:
            raise ValueError("top_logprobs_num and token_ids_logprob are not supported by the local engine")
        request = GenerateRequest(
            list(prompt), parse_sampling_params(sampling), str(rid), -1 if start is None else int(start)
        )
        engine.validate(request)
        _check_context(request, (sampling or {}).get("max_new_tokens"), engine)
        items.append({"request": request, "return_logprob": bool(logprob)})
    return items, single


def _check_context(request: GenerateRequest, max_new_tokens: int | None, engine: LocalEngine) -> None:
    """SGLang's tokenizer manager: a `max_new_tokens` the caller asked for that, with the input,
    reaches the context length is the request's error, unless the server allows auto truncation
    (`allow_auto_truncate`, SGLang's flag); the engine itself caps generation at the context."""
    if max_new_tokens is None or engine.args.allow_auto_truncate:
        return
    num_input, context = len(request.input_ids), engine.context_length
    if num_input + int(max_new_tokens) >= context:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. "
            f"You requested a total of {num_input + int(max_new_tokens)} tokens: {num_input} tokens from "
            f"the input messages and {max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )


def build_response(
    engine: LocalEngine,
    item: dict[str, Any],
    output: GenerateOutput,
    weight_version: str,
    e2e_latency: float,
    text_in_logprobs: bool,
) -> dict[str, Any]:
    """One result exactly as SGLang's tokenizer manager shapes it (`_handle_batch_output`)."""
    request, sampling = item["request"], item["request"].sampling
    finish, ids = output.finish_reason, output.output_ids
    matched = finish.get("matched")
    trim = not sampling.no_stop_trim and bool(matched)  # SGLang's detokenizer: `if not matched`
    text = engine.decode(
        ids[:-1] if trim and isinstance(matched, int) and ids else ids, sampling.skip_special_tokens
    )
    if trim and isinstance(matched, str) and matched in text:
        text = text[: text.find(matched)]

    def triples(values: list[float | None], token_ids: list[int]) -> list[tuple[Any, ...]]:
        """(logprob, token id, text or None) per token: tuples, which JSON writes as SGLang's lists,
        so a batch's 30k tokens cost no list each on the HTTP thread."""
        texts = (
            [engine.decode([t], False) for t in token_ids] if text_in_logprobs else [None] * len(token_ids)
        )
        return list(zip(values, token_ids, texts, strict=True))

    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": finish,
        "prompt_tokens": len(request.input_ids),
        "weight_version": weight_version,
    }
    if item["return_logprob"]:
        start = request.logprob_start_len
        meta["input_token_logprobs"] = (
            triples([None], request.input_ids[-1:])
            if start < 0
            else triples(output.input_logprobs, request.input_ids[start:])
        )
        meta["output_token_logprobs"] = triples(output.output_logprobs, ids)
    meta.update(completion_tokens=len(ids), cached_tokens=0, e2e_latency=e2e_latency)
    return {"text": text, "output_ids": ids, "meta_info": meta}


def model_info_body(engine: LocalEngine) -> dict[str, Any]:
    """GET /get_model_info (and /model_info): sglang 0.5.4's fields plus the newer ones."""
    config = engine.model.config
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "served_model_name": engine.served_model_name,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    }


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error JSON (`http_server.py::_create_error_response`)."""
    return {"error": {"message": message}}
