"""Code shape of ARCHITECTURE.md §2 and the style guide: modules of one concept stay readable.

Product modules stay under 400 lines, functions under 60, and no folder of pipeline/ or launcher/
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


@pytest.mark.parametrize("package", ["pipeline", "launcher"])
def test_no_folder_hides_its_roles(package):
    crowded = []
    for folder in [ROOT / package, *[d for d in (ROOT / package).rglob("*") if d.is_dir()]]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded.append(f"{folder.relative_to(ROOT)} ({len(modules)} modules)")
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules:\n" + "\n".join(crowded)
