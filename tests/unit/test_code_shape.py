"""Code shape of ARCHITECTURE.md §2 and the style guide: modules of one concept stay readable.

Product modules stay under 400 lines, functions under 60, and no folder of pipeline/, launcher/ or workers/
holds more than 12 modules directly (sub-packages show the roles). Generated stubs are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pipeline", "launcher", "workers", "proto")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_MODULES_PER_FOLDER = 12


def _product_modules() -> list[Path]:
    paths = []
    for package in PRODUCT:
        paths += [p for p in (ROOT / package).rglob("*.py") if "_pb2" not in p.name]
    return sorted(paths)


def test_no_product_module_is_over_the_line_limit():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _product_modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_function_is_over_one_screen():
    long = []
    for path in _product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("package", ["pipeline", "launcher", "workers"])
def test_no_folder_hides_its_roles(package):
    crowded = []
    for folder in [ROOT / package, *[d for d in (ROOT / package).rglob("*") if d.is_dir()]]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded.append(f"{folder.relative_to(ROOT)} ({len(modules)} modules)")
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules:\n" + "\n".join(crowded)


# One home per rule: where a piece of maths or naming that several modules need is written, so that
# a second copy shows up when it is written rather than when the copies drift apart. Each entry:
# what the rule is, how a copy shows in a module's syntax tree, and the modules allowed to hold it.
def _rsqrt(node) -> bool:  # the RMS normalisation x * rsqrt(mean(x^2) + eps)
    return isinstance(node, ast.Attribute) and node.attr == "rsqrt"


def _checkpoint_name(node) -> bool:  # the spelling of the embedding and final norm tensors (the tied head)
    return isinstance(node, ast.Constant) and node.value in ("model.embed_tokens.weight", "model.norm.weight")


def _norm_offset(node) -> bool:  # Gemma's (1 + w) norm weight
    return isinstance(node, ast.Attribute) and node.attr == "norm_weight_offset"


def _shipped_name(node) -> bool:  # the `<model>-<hash12>-<kind>-L<layer>` names of shipped predictors
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
        f"{kind}-L" in node.value for kind in ("early-exit", "firp"))


ONE_HOME = {
    "RMS normalisation": (_rsqrt, {"pipeline/model/family_blocks.py"}),
    "checkpoint tensor names": (_checkpoint_name, {"pipeline/model/tensor_names.py"}),
    "Gemma's norm offset": (_norm_offset, {"pipeline/model/config.py", "pipeline/model/family_config.py",
                                           "pipeline/model/family_blocks.py"}),
    "shipped predictor names": (_shipped_name, {"pipeline/speculation/predictor_file.py"}),
}


def _code_nodes(tree: ast.AST):
    """Every node except docstrings (which may name the rules)."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return (n for n in ast.walk(tree) if id(n) not in docstrings)


@pytest.mark.parametrize("rule", list(ONE_HOME))
def test_each_shared_rule_is_written_once(rule):
    found, home = ONE_HOME[rule]
    copies = set()
    for path in _product_modules():
        name = path.relative_to(ROOT).as_posix()
        if name not in home and any(found(n) for n in _code_nodes(ast.parse(path.read_text()))):
            copies.add(name)
    assert not copies, f"{rule} is written outside {sorted(home)}: {sorted(copies)}"
