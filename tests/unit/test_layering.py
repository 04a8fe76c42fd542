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


# [Note: sub-package cycles]
# Inside pipeline/ and launcher/ every folder of modules is one part (pipeline/model, pipeline/speculation,
# pipeline/speculation/drafting, launcher/cli, launcher/cli/training, ...; a package's own top-level
# modules, such as pipeline/run_config.py, are the part named by the package). Part A depends on part B
# when any module of A imports a module of B: at module level, inside a function (a deferred import
# still needs B to exist and to be importable from A, and is only deferred to keep start-up fast) or
# under `if TYPE_CHECKING` (a type is still a dependency). The parts of each package must form no
# cycle, so that each can be read, tested and changed knowing only the parts below it. The CLI's
# entry module, launcher/cli/main.py, is a part of its own above all others: it wires every command
# (`launch`, `serve`, `bench`, `simulate`, `train-predictor`) and nothing may import it, so what two
# commands share lives in a module below it (launcher/cli/options.py).
KNOWN_CYCLES: dict[frozenset[str], str] = {}


ENTRY_MODULE = "launcher/cli/main.py"


def _part(path: Path) -> str:
    name = path.relative_to(ROOT).as_posix()
    return name if name == ENTRY_MODULE else path.parent.relative_to(ROOT).as_posix()


def _target(name: str) -> Path | None:
    """The file or package folder of dotted module `name`, or None outside this repository."""
    base = ROOT.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return base / "__init__.py" if (base / "__init__.py").is_file() else None


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path`, wherever it sits; `from a import b` names
    a.b when b is a module, else a."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if _target(sub) is not None else node.module))
    return out


def part_edges(package: str) -> dict[tuple[str, str], list[str]]:
    """{(part, part it imports): ["file:line module", ...]} between different parts of `package`."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in _modules(package):
        for line, name in dict.fromkeys(_imported_modules(path)):
            target = _target(name) if name.split(".")[0] == package else None
            if target is not None and _part(target) != _part(path):
                edges.setdefault((_part(path), _part(target)), []).append(
                    f"{path.relative_to(ROOT)}:{line} {name}")
    return edges


def cycles(edges) -> list[frozenset[str]]:
    """The strongly connected components of more than one part (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(component: frozenset[str], edges) -> str:
    lines = [" <-> ".join(sorted(component))]
    for (a, b), where in sorted(edges.items()):
        if a in component and b in component:
            lines += [f"  {a} -> {b}:"] + [f"    {w}" for w in where]
    return "\n".join(lines)


@pytest.mark.parametrize("package", ["pipeline", "launcher"])
def test_sub_packages_import_each_other_without_cycles(package):
    """[Note: sub-package cycles]."""
    edges = part_edges(package)
    found = cycles(edges)
    bad = [c for c in found if c not in KNOWN_CYCLES]
    assert not bad, "import cycles between sub-packages:\n" + "\n".join(_describe(c, edges) for c in bad)
    gone = [sorted(k) for k in KNOWN_CYCLES if all(p.split("/")[0] == package for p in k) and k not in found]
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_the_cycle_check_finds_every_cycle_and_only_cycles():
    edges = {("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): [], ("d", "e"): [], ("e", "d"): [],
             ("x", "y"): []}
    assert sorted(map(sorted, cycles(edges))) == [["a", "b", "c"], ["d", "e"]]


def test_nothing_imports_the_cli_entry_module():
    """[Note: sub-package cycles]: serving and the benchmarks use what the commands share through
    launcher/cli/options.py, never through the entry module that wires every command."""
    entry = ENTRY_MODULE.removesuffix(".py").replace("/", ".")
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for package in (*LAYERS, "proto") for path in _modules(package)
           for line, name in _imported_modules(path) if name == entry]
    assert not bad, "\n".join(bad)
