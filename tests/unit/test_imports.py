"""What rlx's modules import, read from their source (ast), nothing imported: the rollout side
reaches rlx's engine only through the server's public entry point, no import cycle, no long file.

How imports are counted: `import a.b` names `a.b`; `from a.b import c` names `a.b`, and `a.b.c`
too when that is a module of rlx; relative imports are resolved. "Module-level" means run when
the module is imported: the file's top level, including under `if`/`try`/`with`, and including
`if TYPE_CHECKING:` (an annotation-only import is a dependency of the design all the same, and the
one cycle this test was written against, the pool and its health monitor, went through one).
Imports inside a function or method (lazy) run only when it is called, after every module has
loaded, so they cannot close an import cycle: the cycle rule leaves them out, the rollout rule
counts them. The parent packages Python imports first (`a` and `a.b` for `a.b.c`) are not counted:
a package that imports its own submodules is not a cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

RLX = Path(__file__).resolve().parents[2] / "rlx"
MAX_LINES = 450
JUSTIFIED = re.compile(r"over 450 lines because", re.IGNORECASE)
# the engine server's public entry point: `start_server` in-process (`rlx.rollout.launchers.LocalLauncher`);
# `python -m rlx.engine.serve` is started by name, no import; and its arguments' schema (`rlx.engine.config`:
# torch and the standard library only), whose values LocalLauncher checks before any engine starts
ENGINE_ENTRY = {"rlx.engine.serve", "rlx.engine.config"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(RLX.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(RLX.rglob("*.py"))}


def _imports(module: str, lazy: bool) -> set[str]:
    """The rlx modules `module` imports: at module level, or anywhere with `lazy`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            if lazy or not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child)

    visit(ast.parse(path.read_text()))
    return {n for n in names if n in MODULES and n != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_rollout_side_reaches_the_engine_only_through_its_servers_entry_point():
    bad = {}
    for module in MODULES:
        if module.startswith("rlx.rollout"):
            engine = {
                n for n in _imports(module, lazy=True) if n == "rlx.engine" or n.startswith("rlx.engine.")
            }
            if engine - ENGINE_ENTRY:
                bad[module] = sorted(engine - ENGINE_ENTRY)
    assert not bad, f"rlx.rollout talks to engines over HTTP; these import the engine: {bad}"


def test_importing_the_rollout_side_loads_none_of_the_engine():
    # the driver and sglang-router's launcher import rlx.rollout: none of it may pull in the
    # engine's model code (torch, the model families) at import time, by any path
    graph = {m: _imports(m, lazy=False) for m in MODULES}
    for module in (m for m in MODULES if m.startswith("rlx.rollout")):
        seen, todo = set(), [module]
        while todo:
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        assert not [m for m in seen if m.startswith("rlx.engine")], (module, sorted(seen))


def test_no_import_cycle_in_rlx():
    cycles = _cycles({m: _imports(m, lazy=False) for m in MODULES})
    assert not cycles, f"module-level import cycles: {cycles}"


def test_no_two_modules_import_each_other_even_lazily():
    # a lazy import cannot close a cycle at import time, but two modules that need each other are
    # one design split in two: the arrows run one way (rlx.models.hf_checkpoint -> rlx.models.family)
    graph = {m: _imports(m, lazy=True) for m in MODULES}
    pairs = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})
    assert not pairs, f"modules that import each other: {pairs}"


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_file_over_450_lines_without_a_reason():
    long = {}
    for path in MODULES.values():
        source = path.read_text()
        num_lines = source.count("\n")
        if num_lines > MAX_LINES and not JUSTIFIED.search(ast.get_docstring(ast.parse(source)) or ""):
            long[str(path.relative_to(RLX.parent))] = num_lines
    assert not long, f"split these, or say in the module docstring 'Over 450 lines because ...': {long}"


# rlx.config in two layers: the rules and `build` every config group imports (a leaf: nothing of rlx
# but its errors), and the composer above the groups (Hydra, the cross-group rules, the schema)
CONFIG_LEAF = {"rlx.config", "rlx.config.rules", "rlx.config.build"}
COMPOSER = {m for m in MODULES if m.startswith("rlx.config.")} - CONFIG_LEAF
LAUNCH_PATH = ("rlx.config", "rlx.launcher", "rlx.runtime", "rlx.tools")  # may compose and validate


def test_the_config_rules_and_build_are_a_leaf():
    for module in sorted(CONFIG_LEAF):
        assert _imports(module, lazy=True) - CONFIG_LEAF <= {"rlx.errors"}, module


def test_only_the_launch_path_imports_the_composer():
    bad = {}
    for module in MODULES:
        if not module.startswith(LAUNCH_PATH) and (composer := _imports(module, lazy=True) & COMPOSER):
            bad[module] = sorted(composer)
    assert not bad, f"config groups and components import only {sorted(CONFIG_LEAF)}: {bad}"


def test_the_composer_asks_launchers_what_they_declare_not_what_they_are_called():
    # engine launchers declare their limits (rlx.rollout.launchers.EngineLauncher); nothing compares
    # a `_target_` string or a launcher's class to decide a rule
    found = []
    for module, path in MODULES.items():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"_target_ *[!=]=|issubclass\(.*Launcher", line):
                found.append(f"{module}:{number}: {line.strip()}")
    assert not found, found


def test_no_test_imports_a_conftest():
    """Two conftest.py files exist (tests/, tests/gpu/): which one `import conftest` finds depends on
    what a worker collected first, so shared helpers live in tests/helpers.py."""
    tests = Path(__file__).resolve().parents[1]
    offenders = [
        str(path.relative_to(tests))
        for path in tests.rglob("*.py")
        if re.search(r"^\s*(from conftest import|import conftest)", path.read_text(), re.MULTILINE)
    ]
    assert offenders == [], offenders
