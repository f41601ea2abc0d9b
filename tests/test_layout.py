"""The packages' import rules, read from the source: the engine and the environments stand
alone, so that each can be served, deployed or replaced without the learning loop."""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _imports(package: str) -> dict[str, set[str]]:
    """file -> every module it imports, at the top or inside a function."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                raise AssertionError(f"{path}: relative import (from {'.' * node.level}{node.module or ''}): "
                                     "the project imports by absolute name")
        found[str(path.relative_to(REPO))] = names
    return found


def _outside(imports: dict[str, set[str]], forbidden, allowed=()) -> dict[str, list[str]]:
    def bad(name):
        return name.split(".")[0] in forbidden and not any(name == a or name.startswith(a + ".") for a in allowed)

    return {f: sorted(n for n in names if bad(n)) for f, names in imports.items() if any(bad(n) for n in names)}


def test_the_engine_imports_glmjax_and_itself_only():
    imports = _imports("rl/engine")
    assert "rl/engine/engine.py" in imports and "rl/engine/serve.py" in imports
    assert _outside(imports, {"rl", "envs", "pallas_kernels"}, allowed=("rl.engine",)) == {}


def test_the_environments_import_nothing_of_the_model_or_the_loop():
    imports = _imports("envs")
    assert "envs/sandbox/sandbox.py" in imports
    assert _outside(imports, {"rl", "glmjax", "pallas_kernels", "jax"}) == {}


def test_the_model_imports_nothing_of_the_loop_or_the_environments():
    assert _outside(_imports("glmjax"), {"rl", "envs"}) == {}


def test_the_tool_call_formats_import_nothing_of_the_project_or_jax():
    """tool_formats is read by both sides (the engine's OpenAI API and the environments)."""
    assert _outside(_imports("tool_formats"), {"rl", "envs", "glmjax", "pallas_kernels", "jax"}) == {}


@pytest.mark.parametrize("package", ["rl", "envs", "glmjax", "tool_formats"])
def test_every_module_of_a_package_has_a_docstring(package):
    missing = [str(p.relative_to(REPO)) for p in (REPO / package).rglob("*.py")
               if p.stat().st_size and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert missing == []
