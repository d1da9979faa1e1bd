"""The JSON both sides of SGLang's API write (`rlx.sglang_api.dumps` / `loads`): orjson where
installed, else the standard library, read the same by the rollout side (`read_output`)."""

import math

import pytest

from rlx import sglang_api
from rlx.rollout.generate import read_output
from rlx.sample import Status


@pytest.fixture(params=["orjson", "json"])
def codec(request, monkeypatch):
    if request.param == "json":
        monkeypatch.setattr(sglang_api, "orjson", None)
    elif sglang_api.orjson is None:
        pytest.skip("orjson is not installed")
    return request.param


def answer(logprobs: list[float]) -> dict:
    """An engine's answer as `rlx.engine.serve.protocol.build_response` shapes it: triples as tuples."""
    ids = [7 + i for i in range(len(logprobs))]
    meta = {"finish_reason": {"type": "length", "length": 3}, "weight_version": "4",
            "output_token_logprobs": list(zip(logprobs, ids, [None] * len(ids), strict=True))}  # fmt: skip
    return {"text": "é 1", "output_ids": ids, "meta_info": meta}


def test_an_answer_travels_as_sglang_writes_it(codec):
    """Tuples arrive as lists, non-string keys as strings (as `json.dumps` writes them), text as text."""
    sent = answer([-0.25, -1.5, 0.0]) | {"metadata": {1: "one", "k": [1, 2]}}
    got = sglang_api.loads(sglang_api.dumps(sent))
    assert got["meta_info"]["output_token_logprobs"] == [[-0.25, 7, None], [-1.5, 8, None], [0.0, 9, None]]
    assert got["metadata"] == {"1": "one", "k": [1, 2]}
    assert got["text"] == "é 1" and got["output_ids"] == [7, 8, 9]
    out = read_output(got, version=0)
    assert out.ids == [7, 8, 9] and out.logprobs == [-0.25, -1.5, 0.0]
    assert all(type(v) is float for v in out.logprobs) and (out.version, out.status) == (4, Status.TRUNCATED)


def test_a_non_finite_logprob_arrives_as_nan_with_either_encoder(codec):
    """orjson writes NaN as null (SGLang's answers too), the standard library as NaN: both read as NaN;
    the finite logprobs beside it are kept."""
    got = read_output(sglang_api.loads(sglang_api.dumps(answer([-0.5, math.nan, -2.0]))), version=0)
    assert got.ids == [7, 8, 9]
    assert got.logprobs[0] == -0.5 and math.isnan(got.logprobs[1]) and got.logprobs[2] == -2.0


def test_a_body_that_is_not_json_is_a_value_error(codec):
    with pytest.raises(ValueError):
        sglang_api.loads(b"{not json")
