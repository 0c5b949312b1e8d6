"""docs/reference.md says what the code is: every public name is in it, and every signature it
shows is the one ``inspect.signature`` gives.

A signature is a fenced block with the info string ``python signature``, one per block:
``Name(params) -> ret``, ``Name.method(params) -> ret``, or ``await Name.method(...)`` for a
coroutine. Parameters are written as in a ``def``: names, kinds, annotations (as the source spells
them) and defaults (any expression, evaluated in the defining module) must all match. The check is
driven by ``gpu_asgi.__all__``, so a name that joins or leaves the public API changes what it asks.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import gpu_asgi

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```", re.S | re.M)
SIGNATURE = re.compile(
    r"^(?P<await>await\s+)?(?P<name>[A-Za-z_][\w.]*)\((?P<params>.*)\)(?:\s*->\s*(?P<ret>.+))?$", re.S
)


def signature_blocks(text: str) -> list[tuple[int, str]]:
    """(line, text) of every ``python signature`` block."""
    return [
        (text[: match.start()].count("\n") + 1, match["body"].strip())
        for match in FENCE.finditer(text)
        if match["info"].strip() == "python signature"
    ]


def documented_names(text: str) -> set[str]:
    """Names a heading gives (``### `Name`, `Other` ``), and the first cells of tables whose first
    column is headed ``name`` or ``error`` (``| `Name` |``); option tables name parameters instead."""
    headings = [name for line in re.findall(r"^#+ .*$", text, re.M) for name in re.findall(r"`([A-Za-z_]\w*)`", line)]
    rows = []
    for table in re.findall(r"(?:^\|.*\n)+", text, re.M):
        header, _, *body = table.splitlines()
        if header.split("|")[1].strip() in ("name", "error"):
            rows += [name for line in body for name in re.findall(r"^\| `([A-Za-z_]\w*)`", line)]
    return set(headings) | set(rows)


def resolve(dotted: str) -> tuple[Any, bool]:
    """The object ``gpu_asgi.<dotted>`` names, and whether it is a method read from its class
    (its signature then starts with ``self``)."""
    head, *rest = dotted.split(".")
    obj: Any = getattr(gpu_asgi, head)
    unbound = False
    for attribute in rest:
        static = inspect.getattr_static(obj, attribute)
        unbound = inspect.isclass(obj) and inspect.isfunction(static)
        obj = getattr(obj, attribute)
    return obj, unbound


def normalized(annotation: str) -> str:
    return ast.unparse(ast.parse(annotation, mode="eval"))


def namespace_of(obj: Any) -> dict[str, Any]:
    """Names as the module that defines ``obj`` sees them (``__module__`` reads ``gpu_asgi`` for
    public names, so the globals of a function it defines are asked instead)."""
    if inspect.isclass(obj):
        functions = [value for value in vars(obj).values() if inspect.isfunction(value)]
    else:
        functions = [obj] if inspect.isfunction(obj) else []
    defining = functions[0].__globals__ if functions else vars(sys.modules[getattr(obj, "__module__", "gpu_asgi")])
    return {**vars(gpu_asgi), **defining}


def actual_default(owner: Any, parameter: inspect.Parameter) -> Any:
    """The default, with a dataclass field's ``default_factory`` called (``inspect`` shows ``<factory>``)."""
    if inspect.isclass(owner) and dataclasses.is_dataclass(owner):
        for field in dataclasses.fields(owner):
            if field.name == parameter.name and field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
    return parameter.default


def same_default(documented: Any, actual: Any) -> bool:
    # Same type too, so that 1, 1.0 and True differ; any mapping may be written as a dict.
    alike = type(documented) is type(actual) or (isinstance(documented, Mapping) and isinstance(actual, Mapping))
    return documented is actual or (alike and documented == actual)


def init_only(annotation: Any) -> Any:
    """A dataclass's init-only field (``InitVar[X]``) is a constructor parameter of type ``X``: the
    wrapper says only that the instance keeps no attribute of it, so the docs show ``X``."""
    if isinstance(annotation, str) and (match := re.fullmatch(r"(?:dataclasses\.)?InitVar\[(.*)\]", annotation)):
        return match[1]
    if isinstance(annotation, dataclasses.InitVar):
        return annotation.type
    return annotation


def mismatches(line: int, text: str) -> list[str]:
    where = f"docs/reference.md:{line}"
    match = SIGNATURE.match(text)
    if match is None:
        return [f"{where}: not `Name(params) -> ret`: {text!r}"]
    try:
        obj, unbound = resolve(match["name"])
    except AttributeError as error:
        return [f"{where}: {match['name']}: {error}"]
    returns = f" -> {match['ret']}" if match["ret"] else ""
    try:
        (stub,) = ast.parse(f"def _({match['params']}){returns}: ...").body
    except SyntaxError as error:
        return [f"{where}: does not parse as parameters: {error}"]
    assert isinstance(stub, ast.FunctionDef)
    actual = inspect.signature(obj)
    parameters = list(actual.parameters.values())[1:] if unbound else list(actual.parameters.values())
    problems = []
    if bool(match["await"]) != inspect.iscoroutinefunction(obj):
        problems.append(f"{where}: {match['name']} is {'' if inspect.iscoroutinefunction(obj) else 'not '}a coroutine")

    args = stub.args
    documented: list[tuple[str, inspect._ParameterKind, ast.expr | None, ast.expr | None]] = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for index, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        positional_kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if index < len(args.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        documented.append((arg.arg, positional_kind, arg.annotation, default))
    if args.vararg:
        documented.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, args.vararg.annotation, None))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        documented.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, arg.annotation, kw_default))
    if args.kwarg:
        documented.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, args.kwarg.annotation, None))

    names = [name for name, *_ in documented]
    if names != [parameter.name for parameter in parameters]:
        return [*problems, f"{where}: {match['name']} parameters {names} != {[p.name for p in parameters]}"]
    namespace = namespace_of(obj)
    for (name, kind, annotation, default), parameter in zip(documented, parameters, strict=True):
        if kind != parameter.kind:
            problems.append(f"{where}: {name} is {parameter.kind.description}, documented {kind.description}")
        real_annotation = init_only(parameter.annotation)
        if real_annotation is inspect.Parameter.empty:
            if annotation is not None:
                problems.append(f"{where}: {name} has no annotation in the code")
        elif annotation is None or ast.unparse(annotation) != normalized(str(real_annotation)):
            shown = None if annotation is None else ast.unparse(annotation)
            problems.append(f"{where}: {name}: {shown} != {real_annotation}")
        if parameter.default is inspect.Parameter.empty:
            if default is not None:
                problems.append(f"{where}: {name} has no default in the code")
        elif default is None:
            problems.append(f"{where}: {name} has a default in the code ({parameter.default!r})")
        else:
            # The docs' own text, evaluated where the code's default is written.
            value = eval(compile(ast.Expression(default), where, "eval"), namespace)
            if not same_default(value, actual_default(obj, parameter)):
                problems.append(f"{where}: {name} = {ast.unparse(default)} != {parameter.default!r}")
    real_return = actual.return_annotation
    if not inspect.isclass(obj) and real_return is not inspect.Signature.empty:
        if match["ret"] is None or normalized(match["ret"]) != normalized(str(real_return)):
            problems.append(f"{where}: returns {match['ret']} != {real_return}")
    elif match["ret"] is not None:
        problems.append(f"{where}: documents a return annotation the code does not have")
    return problems


TEXT = REFERENCE.read_text()
BLOCKS = signature_blocks(TEXT)


def test_every_public_name_is_documented() -> None:
    missing = sorted(set(gpu_asgi.__all__) - documented_names(TEXT))
    assert missing == [], f"in gpu_asgi.__all__ but not in docs/reference.md: {missing}"


def test_every_documented_name_is_importable_from_gpu_asgi() -> None:
    names = documented_names(TEXT) | {
        match["name"].split(".")[0] for _, text in BLOCKS if (match := SIGNATURE.match(text))
    }
    assert sorted(name for name in names if not hasattr(gpu_asgi, name)) == []


def test_every_public_function_and_class_shows_a_signature() -> None:
    # A function its own; a class its constructor or a member's (``TenantKey.header``, ``Estimator.estimate``).
    shown = {match["name"] for _, text in BLOCKS if (match := SIGNATURE.match(text))}
    missing = []
    for name in gpu_asgi.__all__:
        obj = getattr(gpu_asgi, name)
        if inspect.isfunction(obj) and name not in shown:
            missing.append(name)
        elif inspect.isclass(obj) and not issubclass(obj, BaseException):
            if not any(each == name or each.startswith(f"{name}.") for each in shown):
                missing.append(name)
    assert missing == []


@pytest.mark.parametrize(("line", "text"), BLOCKS, ids=[f"line {line}" for line, _ in BLOCKS])
def test_documented_signature_is_the_real_one(line: int, text: str) -> None:
    assert mismatches(line, text) == []


def test_a_wrong_signature_is_caught() -> None:
    # The checker itself: each of these differs from the code in one way.
    wrong = [
        "Ledger(capacity: int | Mapping[str, int], *, max_queue: int = 255, max_wait: float = 30.0, max_bypass: int = 8,"
        " tenants: Mapping[str, TenantPolicy] | None = None, default_tenant_policy: TenantPolicy = TenantPolicy(),"
        " tenant_idle_ttl: float = 300.0, clock: Callable[[], float] = time.monotonic)",
        "budget_bytes(total_bytes: int, utilization: float = 0.9, *, weights_bytes: int = 0, runtime_overhead_bytes: int = 0) -> int",
        "budget_bytes(total_bytes: float, *, utilization: float = 0.9, weights_bytes: int = 0, runtime_overhead_bytes: int = 0) -> int",
        "budget_bytes(total_bytes: int, *, utilization: float = 0.9, weights_bytes: int = 0) -> int",
        "budget_bytes(total_bytes: int, *, utilization: float = 0.9, weights_bytes: int = 0, runtime_overhead_bytes: int = 0) -> float",
        "await api_key_tenant(key: str, *, secret: bytes | None = None) -> str",
        "Ledger.try_reserve(nbytes: int, *, devices: Sequence[str] | None = None) -> Reservation | None",
    ]
    for text in wrong:
        assert mismatches(0, text) != [], text
    right = "budget_bytes(total_bytes: int, *, utilization: float = 0.9, weights_bytes: int = 0, runtime_overhead_bytes: int = 0) -> int"
    assert mismatches(0, right) == []
