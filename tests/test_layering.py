"""The package's parts import one way and in no circle (docs/architecture.md, "Which way imports
run"), type-only imports included: checked here from the source, so the rule holds without any
tool outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpu_asgi"
#: Top-down: a part may import only itself and the parts after it.
ORDER = ("_vllm", "_asgi", "_admission", "_observe", "_ledger", "_device", "_estimate")
#: Shared leaves: any part may import them, and they import no part.
LEAVES = ("_errors", "_types", "_lifecycle", "_timers")
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, source: str, known: set[str], *, package: bool = False) -> set[str]:
    """The package's modules that module ``name`` (``source``; ``package``: an ``__init__``)
    imports, at any depth of its code (``TYPE_CHECKING`` blocks too)."""
    here = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known
            # ``from . import spec`` imports the submodule; ``from .x import Name`` the module x.
            found |= submodules if len(submodules) == len(node.names) else submodules | {target}
    return {module for module in found if module in known and module != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: imports_of(name, path.read_text(encoding="utf-8"), set(known), package=path.name == "__init__.py")
        for name, path in known.items()
    }


def part_of(module: str) -> str | None:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[1] in ORDER + LEAVES else None


def test_every_part_and_leaf_exists() -> None:
    parts = {part_of(name) for name in modules()} - {None}
    assert parts == set(ORDER + LEAVES)


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the order."""
    wrong = []
    for module, imported in sorted(edges.items()):
        mine = part_of(module)
        if mine is None:
            continue  # the public facades (gpu_asgi, gpu_asgi.vllm, ...) may import any part
        for other in sorted(imported):
            theirs = part_of(other)
            if theirs is None:
                wrong.append(f"{module} imports the public facade {other}")
            elif mine in LEAVES:
                if theirs not in LEAVES:
                    wrong.append(f"the leaf {module} imports {other}")
            elif theirs not in LEAVES and ORDER.index(theirs) < ORDER.index(mine):
                wrong.append(f"{module} ({mine}) imports upward: {other} ({theirs})")
    return wrong


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Import circles, each as the modules around it (found by a depth-first walk)."""
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1  # on the current path
        for other in sorted(edges.get(module, ())):
            if state.get(other) == 1:
                found.append([*path[path.index(other):], other])
            elif other not in state:
                visit(other, [*path, other])
        state[module] = 2  # done

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return found


def test_no_part_imports_upward_and_leaves_import_no_part() -> None:
    assert upward(graph()) == []


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def test_the_map_names_every_part_and_module() -> None:
    """docs/architecture.md has a row per part naming each of its modules (a subpackage's as
    ``redis/`` and its modules), and names each module outside the parts by its file."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    rows = {match[1]: match[2] for match in re.finditer(r"^\| `(_\w+)` \|(.*)$", text, re.M)}
    assert set(rows) == set(ORDER)
    missing = []
    for name in modules():
        pieces = name.split(".")[1:]
        if not pieces or (len(pieces) == 1 and pieces[0] in ORDER):
            continue  # the package itself, a part's own __init__
        if pieces[0] not in ORDER:
            file = "/".join(pieces) + ".py"
            if f"`{file}`" not in text and f"`gpu_asgi/{file}`" not in text:
                missing.append(file)
            continue
        row = rows[pieces[0]]
        missing += [f"{pieces[0]}: {piece}" for piece in pieces[1:-1] if f"`{piece}/`" not in row]
        if f"`{pieces[-1]}`" not in row and f"`{pieces[-1]}/`" not in row:
            missing.append(f"{pieces[0]}: {pieces[-1]}")
    assert missing == []


def test_the_checks_can_fail() -> None:
    edges = graph()
    edges["gpu_asgi._ledger.memory"] = edges["gpu_asgi._ledger.memory"] | {"gpu_asgi._asgi.middleware"}
    assert upward(edges) == [
        "gpu_asgi._ledger.memory (_ledger) imports upward: gpu_asgi._asgi.middleware (_asgi)"
    ]
    assert "gpu_asgi._ledger.contract" in edges["gpu_asgi._ledger.memory"]
    edges["gpu_asgi._ledger.contract"] = edges["gpu_asgi._ledger.contract"] | {"gpu_asgi._ledger.memory"}
    assert ["gpu_asgi._ledger.contract", "gpu_asgi._ledger.memory", "gpu_asgi._ledger.contract"] in circles(edges)
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from .._ledger.contract import Reservation", {"gpu_asgi._ledger.contract"}),
        ("from . import spec", {"gpu_asgi._admission.spec"}),
        ("from .spec import RouteSpec", {"gpu_asgi._admission.spec"}),
        ("from .. import _errors", {"gpu_asgi._errors"}),
        ("from .. import _errors, __version__", {"gpu_asgi", "gpu_asgi._errors"}),
        ("import gpu_asgi._types", {"gpu_asgi._types"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._observe.metrics import GPUMetrics",
         {"gpu_asgi._observe.metrics"}),
        ("import json\nfrom starlette.requests import Request", set()),
    ],
)
def test_imports_are_resolved_as_python_resolves_them(source: str, expected: set[str]) -> None:
    """The checker itself, on sources written as if they were gpu_asgi/_admission/gate.py."""
    assert imports_of("gpu_asgi._admission.gate", source, set(modules())) == expected


