"""A launch's preparation the second time round (rlx.models.tokenizer.load_tokenizer, the tiny
checkpoint's path, the expected tensor shapes): the same tokenizer AutoTokenizer loads, without
importing transformers' config and auto classes, which load its auto-model factory (seconds on a
GPU host). The first time runs in this process and fills the cache (RLX_CACHE); the second in a
new process, as the next launch."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["What is 7 * 8?", "reverse: 3 1 4 1 5", ""]

PROBE = """
import json, sys
from rlx.models.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
print(json.dumps({"tokenizer": report(tok), "auto": sorted(m for m in sys.modules if m.startswith("transformers.models.auto"))}))
"""


def report(tok) -> dict:
    """What a run sees of a tokenizer (sent to the new process by its source)."""
    chat = None
    if tok.chat_template:
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    return {
        "class": f"{type(tok).__module__}.{type(tok).__qualname__}",
        "ids": [tok(t).input_ids for t in TEXTS],
        "special": sorted(tok.all_special_tokens),
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "chat": chat,
    }


def _in_new_process(code: str, cache: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLX_CACHE": str(cache)}
    prelude = f"TEXTS = {TEXTS!r}\n{inspect.getsource(report)}\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + code, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_second_load_is_autotokenizers_tokenizer_without_its_imports(
    tiny_qwen3_dir, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    from rlx.models.tokenizer import load_tokenizer

    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    # the tiny checkpoint's generic class, and Qwen2Tokenizer, which v5 builds from the vocabulary
    qwen2 = tmp_path / "qwen2"
    shutil.copytree(tiny_qwen3_dir, qwen2)
    config = json.loads((qwen2 / "tokenizer_config.json").read_text())
    (qwen2 / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "Qwen2Tokenizer"}))
    for hf_dir in (tiny_qwen3_dir, qwen2):
        expected = report(AutoTokenizer.from_pretrained(str(hf_dir)))
        assert report(load_tokenizer(hf_dir)) == expected
        seen = _in_new_process(PROBE, tmp_path, str(hf_dir))
        assert seen == {"tokenizer": expected, "auto": []}, seen
    assert expected["class"].endswith("Qwen2Tokenizer")
    assert len(list((tmp_path / "tokenizer_classes").iterdir())) == 2  # a key each


def test_remote_code_is_never_remembered(tiny_qwen3_dir, tmp_path):
    from rlx.models.tokenizer import _key

    remote = tmp_path / "remote"
    shutil.copytree(tiny_qwen3_dir, remote)
    config = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(
        json.dumps(config | {"auto_map": {"AutoTokenizer": ["t.T", None]}})
    )
    assert _key(remote) is None and _key(tiny_qwen3_dir) is not None


PREPARE = """
import sys, tempfile
from rlx import runtime
from rlx.config.compose import compose
runtime._prepare(compose([f"run.output_dir={tempfile.mkdtemp()}", *sys.argv[1:]]))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("transformers.models.auto"))))
"""


def test_a_second_preparation_imports_no_auto_class(tiny_qwen3_dir, tmp_path, monkeypatch):
    """The default tiny model and a checkpoint by path: the second launch's preparation imports
    none of transformers' auto classes."""
    from rlx import runtime
    from rlx.config.compose import compose

    for case, overrides in enumerate(([], [f"model.hf_checkpoint={tiny_qwen3_dir}"])):
        cache = tmp_path / f"cache{case}"
        monkeypatch.setenv("RLX_CACHE", str(cache))
        runtime._prepare(compose([f"run.output_dir={tempfile.mkdtemp(dir=tmp_path)}", *overrides]))
        assert _in_new_process("import json\n" + PREPARE, cache, *overrides) == [], overrides
