"""`python -m rlx.tools.hf_eval --dtype`: which dtype transformers loads the export in."""

import pytest
import torch

from rlx.tools import hf_eval


def test_auto_is_the_checkpoints_own_on_a_gpu_and_fp32_on_the_cpu():
    assert hf_eval.load_dtype("auto", cuda=True) == "auto"
    assert hf_eval.load_dtype("auto", cuda=False) is torch.float32


@pytest.mark.parametrize("cuda", [True, False])
def test_a_named_dtype_is_loaded_as_named_on_either_device(cuda):
    assert hf_eval.load_dtype("float32", cuda) is torch.float32
    assert hf_eval.load_dtype("bfloat16", cuda) is torch.bfloat16
    assert hf_eval.load_dtype("float16", cuda) is torch.float16


def test_an_unknown_dtype_is_named_with_the_choices():
    with pytest.raises(SystemExit, match=r"--dtype fp8: not one of auto, float32, bfloat16, float16"):
        hf_eval.load_dtype("fp8", cuda=False)


def test_the_command_line_rejects_an_unknown_dtype_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):
        hf_eval.main([str(tmp_path), "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
