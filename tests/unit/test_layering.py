"""Layering of ARCHITECTURE.md §2: imports point down only (launcher -> workers -> pipeline),
the pure core never touches grpc, ray or process groups, and nothing unpickles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"pipeline": 0, "workers": 1, "launcher": 2}
FORBIDDEN_IN_PIPELINE = ("grpc", "ray", "torch.distributed", "proto", "transformers")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", list(LAYERS))
def test_imports_point_down_only(package):
    bad = []
    for path in _modules(package):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in LAYERS and LAYERS[top] > LAYERS[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_pure_core_has_no_rpc_or_process_groups():
    bad = []
    for path in _modules("pipeline"):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_PIPELINE):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "pipeline/ must stay pure:\n" + "\n".join(bad)


def test_nothing_unpickles():
    bad = []
    for package in (*LAYERS, "proto"):
        for path in _modules(package):
            text = path.read_text()
            if "import pickle" in text or "pickle.loads" in text:
                bad.append(f"{path.relative_to(ROOT)} uses pickle")
            for node in ast.walk(ast.parse(text)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                        and not any(k.arg == "weights_only" for k in node.keywords)):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.load without weights_only")
    assert not bad, "\n".join(bad)
