"""The code's shape, read from its source: serve-time modules import no build-time module, nothing
in slm_core imports TorchServe, and no module outside slm_core/tasks asks which kind a task is."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "slm_core"
# The build half: compiling a task (slm_core/compile) and the Python API that joins both halves.
COMPILE_TIME = [*(CORE / "compile").glob("*.py"), CORE / "api.py"]
# What a worker runs: every other module of slm_core (serve/, tasks/, the shared ones), and the handler.
SERVE_TIME = sorted({*CORE.rglob("*.py")} - set(COMPILE_TIME)) + [REPO / "handlers" / "slm_handler.py"]
# What a worker never imports: a package holds its weights in the graph, and a catalog's arrays in
# safetensors' numpy format (slm_core.item_trie), not as torch checkpoints.
BUILD_TIME = ("slm_core.compile", "slm_core.api", "slm_kernels", "transformers", "gguf", "safetensors.torch")
KINDS = {"score", "beam", "labels", "classifier", "embedding", "mlp"}  # the task YAML's `task` and `head` values


def imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """Every module an import statement names (top level or inside a function)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found += [(node.module, node)] + [(f"{node.module}.{a.name}", node) for a in node.names]
    return found


def enclosing_function(tree: ast.AST, target: ast.AST) -> str | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(n is target for n in ast.walk(node)):
            return node.name
    return None


@pytest.mark.parametrize("path", SERVE_TIME, ids=lambda p: str(p.relative_to(REPO)))
def test_serve_time_modules_import_no_build_time_module(path):
    tree = ast.parse(path.read_text())
    for name, node in imports(tree):
        if name.startswith(BUILD_TIME):
            # the one door: `from slm_core import Engine` (the Python API) imports it on first use
            lazy = path == CORE / "__init__.py" and enclosing_function(tree, node) == "__getattr__"
            assert lazy, f"{path.relative_to(REPO)}:{node.lineno} imports {name}"


def test_the_halves_cover_the_engine():
    """Every module of slm_core is in one half: a new folder or module is sorted by where it lies."""
    assert (
        len(SERVE_TIME) > 20
        and (CORE / "item_trie.py") in SERVE_TIME
        and (CORE / "compile" / "model.py") not in SERVE_TIME
    )
    assert {p.relative_to(CORE).parts[0] for p in CORE.rglob("*.py") if len(p.relative_to(CORE).parts) > 1} == {
        "compile",
        "serve",
        "tasks",
    }, "a new folder in slm_core: say which half it belongs to here"


def test_the_engine_core_never_imports_torchserve():
    for path in CORE.rglob("*.py"):
        assert not [n for n, _ in imports(ast.parse(path.read_text())) if n == "ts" or n.startswith("ts.")], path


def test_no_branch_on_the_task_kind_outside_the_task_modules():
    """No comparison with a kind's name ("score", "beam", ...) in the product code outside
    slm_core/tasks: the engine, protocol, replay, package, archiver and handler go through the
    Task interface."""
    product = [*CORE.rglob("*.py"), *(REPO / "handlers").glob("*.py"), *(REPO / "archiver").rglob("*.py")]
    for path in product:
        if CORE / "tasks" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = {c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)}
                for c in (node.left, *node.comparators):
                    if isinstance(c, (ast.Tuple, ast.List, ast.Set)):
                        names |= {e.value for e in c.elts if isinstance(e, ast.Constant)}
                assert not names & KINDS, f"{path.relative_to(REPO)}:{node.lineno} compares with {names & KINDS}"


def test_the_check_finds_what_it_looks_for(tmp_path):
    """The checks above fail on code that breaks them (each scanner sees such a line)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(task):\n    from slm_core.compile.model import Transformer\n    return task.task == 'score'\n"
    )
    tree = ast.parse(bad.read_text())
    assert [n for n, _ in imports(tree)][0] == "slm_core.compile.model"
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert compares and compares[0].comparators[0].value in KINDS
