"""rlx.compat.liger: liger-kernel's modules import without peft, and peft stays importable.

The CPU machine has neither package: a stand-in `liger_kernel` whose `utils` begins as liger's does
(`try: import peft` to set PEFT_AVAILABLE) and a stand-in `peft` that counts its imports are
written to a temporary directory put first on the path.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from rlx.compat import liger

UTILS = """\
try:
    import peft  # noqa: F401

    PEFT_AVAILABLE = True
except ImportError:
    PEFT_AVAILABLE = False
"""


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    (tmp_path / "liger_kernel" / "ops").mkdir(parents=True)
    (tmp_path / "liger_kernel" / "__init__.py").write_text("")
    (tmp_path / "liger_kernel" / "utils.py").write_text(UTILS)
    (tmp_path / "liger_kernel" / "ops" / "__init__.py").write_text(
        "from liger_kernel.utils import PEFT_AVAILABLE\n"
    )
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "__init__.py").write_text(
        "import builtins\nbuiltins.peft_imports = getattr(builtins, 'peft_imports', 0) + 1\n"
    )
    for name in [m for m in sys.modules if m.split(".")[0] in ("liger_kernel", "peft")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in ("liger_kernel", "peft")]:
        del sys.modules[name]
    import builtins

    if hasattr(builtins, "peft_imports"):
        del builtins.peft_imports


def test_liger_loads_without_peft_and_peft_imports_after(stand_ins):
    import builtins

    ops = liger.module("liger_kernel.ops")
    assert ops.PEFT_AVAILABLE is False  # liger's `import peft` failed: it was never run
    assert "peft" not in sys.modules and not hasattr(builtins, "peft_imports")
    import peft  # noqa: F401  (the entry hiding it is gone)

    assert builtins.peft_imports == 1
    assert liger.module("liger_kernel.utils") is sys.modules["liger_kernel.utils"]


def test_a_process_that_imported_peft_keeps_it_for_liger(stand_ins):
    import peft  # noqa: F401

    assert liger.module("liger_kernel.ops").PEFT_AVAILABLE is True
