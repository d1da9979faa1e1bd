"""rlx.compat.liger: liger-kernel's modules import without peft or transformers, and both stay
importable; the functions liger marks with `torch.compiler.disable` are marked at their first call.

The CPU machine has no liger-kernel: a stand-in `liger_kernel` whose `utils` begins as liger's does
(`try: import peft` to set PEFT_AVAILABLE) and asks transformers about an NPU as liger's does
(`is_npu_available`, which its ops call as they load), and stand-ins for `peft` and `transformers`
that count their imports, are written to a temporary directory put first on the path (the real
transformers, where a test before loaded it, is set aside meanwhile).
"""

from __future__ import annotations

import builtins
import importlib
import sys

import pytest
import torch

from rlx.compat import liger

UTILS = """\
try:
    import peft  # noqa: F401

    PEFT_AVAILABLE = True
except ImportError:
    PEFT_AVAILABLE = False


def is_npu_available():
    try:
        from transformers.utils import is_torch_npu_available

        return is_torch_npu_available()
    except Exception:
        return False
"""

OPS = """\
import torch

from liger_kernel.utils import PEFT_AVAILABLE, is_npu_available

NPU = is_npu_available()


@torch.compiler.disable
def dispatch(x):
    return x + 1


@torch.compiler.disable(recursive=False)
def dispatch_flat(x):
    return x * 2
"""

COUNTED = "import builtins\nbuiltins.{name}_imports = getattr(builtins, '{name}_imports', 0) + 1\n"
STAND_INS = ("liger_kernel", "peft", "transformers")


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    (tmp_path / "liger_kernel" / "ops").mkdir(parents=True)
    (tmp_path / "liger_kernel" / "__init__.py").write_text("")
    (tmp_path / "liger_kernel" / "utils.py").write_text(UTILS)
    (tmp_path / "liger_kernel" / "ops" / "__init__.py").write_text(OPS)
    for name in ("peft", "transformers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(COUNTED.format(name=name))
    (tmp_path / "transformers" / "utils.py").write_text("def is_torch_npu_available():\n    return 'asked'\n")
    for name in [m for m in sys.modules if m.split(".")[0] in STAND_INS]:
        monkeypatch.delitem(sys.modules, name)  # the real ones come back after the test
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in STAND_INS]:
        del sys.modules[name]
    for name in ("peft", "transformers"):
        if hasattr(builtins, f"{name}_imports"):
            delattr(builtins, f"{name}_imports")


def test_liger_loads_without_peft_or_transformers_and_both_import_after(stand_ins):
    ops = liger.module("liger_kernel.ops")
    assert ops.PEFT_AVAILABLE is False  # liger's `import peft` failed: it was never run
    assert ops.NPU is False  # nor was transformers asked
    for name in ("peft", "transformers"):
        assert name not in sys.modules and not hasattr(builtins, f"{name}_imports")
    import peft  # noqa: F401  (the entries hiding them are gone)
    import transformers.utils

    assert builtins.peft_imports == 1 and builtins.transformers_imports == 1
    assert transformers.utils.is_torch_npu_available() == "asked"
    assert liger.module("liger_kernel.utils") is sys.modules["liger_kernel.utils"]


def test_a_process_that_imported_them_keeps_them_for_liger(stand_ins):
    import peft  # noqa: F401
    import transformers  # noqa: F401

    ops = liger.module("liger_kernel.ops")
    assert ops.PEFT_AVAILABLE is True and ops.NPU == "asked"
    assert builtins.peft_imports == 1 and builtins.transformers_imports == 1


def test_liger_marks_its_functions_not_compiled_when_they_are_first_called(stand_ins, monkeypatch):
    """`torch.compiler.disable` imports dynamo: recorded here, it is not called while liger loads,
    then once for each marked function at its first call (with the marker's arguments), and it
    is torch's own again after the load."""
    marked = []

    def disable(fn=None, recursive=True, **kwargs):
        marked.append((fn.__name__, recursive))
        return fn

    monkeypatch.setattr(torch.compiler, "disable", disable)
    ops = liger.module("liger_kernel.ops")
    assert marked == [] and torch.compiler.disable is disable
    assert ops.dispatch(1) == 2 and ops.dispatch(2) == 3 and ops.dispatch_flat(3) == 6
    assert marked == [("dispatch", True), ("dispatch_flat", False)]
    assert ops.dispatch.__name__ == "dispatch"
