"""The docs work as written: their Python blocks run, and their commands, modules and extras exist.

Convention (README.md, "Docs"): a fenced block whose info string is ``python`` runs as it stands;
``python fragment`` marks an excerpt that needs things defined elsewhere (a GPU, a model, an app)
and is only checked to parse; ``python signature`` (docs/reference.md) is a signature that
tests/test_reference.py compares with the code. Each document's runnable blocks run in order, in one fresh process,
with tracing exports off and no model hub.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    document: Path
    line: int
    info: str
    code: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    def __str__(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def blocks(language: str) -> list[Block]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in FENCE.finditer(text):
            indent = len(match["indent"])
            code = "\n".join(line[indent:] for line in match["body"].splitlines())
            block = Block(document, text[: match.start()].count("\n") + 1, match["info"].strip(), code)
            if block.language == language:
                found.append(block)
    return found


def environment() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OTEL_TRACES_EXPORTER": "none",  # configure_tracing() in a block must not export anywhere
        "HF_HUB_OFFLINE": "1",
    }


@pytest.mark.parametrize("block", blocks("python"), ids=str)
def test_every_python_block_parses_and_says_whether_it_runs(block: Block) -> None:
    assert block.info in ("python", "python fragment", "python signature"), f"{block}: unknown info string {block.info!r}"
    if block.info == "python signature":
        assert block.document.name == "reference.md", f"{block}: signatures are checked in docs/reference.md only"
    else:
        ast.parse(block.code, filename=str(block))


RUNNABLE = sorted({block.document for block in blocks("python") if block.info == "python"})


@pytest.mark.parametrize("document", RUNNABLE, ids=lambda path: str(path.relative_to(ROOT)))
def test_runnable_python_blocks_run(document: Path) -> None:
    code = "\n\n".join(b.code for b in blocks("python") if b.document == document and b.info == "python")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("url", [None, "memory://"])
def test_the_deployment_lifespan_starts_and_stops_with_the_in_process_ledger(url: str | None) -> None:
    # docs/deployment.md offers both in its comment; its shutdown used to call a missing aclose().
    (block,) = [b for b in blocks("python") if b.document.name == "deployment.md" and b.info == "python"]
    driver = (
        "\nimport asyncio\n"
        "async def main():\n"
        "    async with app.router.lifespan_context(app):\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "print(type(ledger).__name__)\n"
    )
    env = environment()
    env.pop("LEDGER_URL", None)
    if url is not None:
        env["LEDGER_URL"] = url
    result = subprocess.run(
        [sys.executable, "-c", block.code + driver], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "Ledger"


def shell_commands() -> list[tuple[Block, list[str]]]:
    commands = []
    for block in blocks("bash"):
        text = re.sub(r"\\\n\s*", " ", block.code)  # join continued lines
        for line in text.splitlines():
            line = line.split(" #")[0].strip()
            for part in re.split(r"&&|;|\|", line):
                words = shlex.split(part.replace("&", " "), comments=True)
                if words:
                    commands.append((block, words))
    return commands


def test_documented_modules_paths_and_extras_exist() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    missing = []
    for block, words in shell_commands():
        for index, word in enumerate(words):
            if word == "-m" and index + 1 < len(words) and words[index - 1].endswith("python"):
                module = words[index + 1]
                if module not in ("venv", "pytest") and importlib.util.find_spec(module) is None:
                    missing.append(f"{block}: python -m {module}")
            if word == "-f" and words[0] == "locust" and not (ROOT / words[index + 1]).is_file():
                missing.append(f"{block}: {words[index + 1]}")
            for extra in re.findall(r"(?:gpu_asgi|\.)\[([\w,]+)\]", word):
                missing += [f"{block}: extra [{name}]" for name in extra.split(",") if name not in extras]
    assert missing == []


@pytest.mark.parametrize(
    ("module", "says"), [("demo_service", "--reject-status"), ("demo_service.loadtest", "--honour-retry-after")]
)
def test_documented_commands_answer_help(module: str, says: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert says in result.stdout


def test_console_scripts_point_at_functions() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"gpu-asgi-demo", "gpu-asgi-loadtest"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        source = Path(importlib.util.find_spec(module).origin)  # type: ignore[union-attr,arg-type]
        assert f"def {name}(" in source.read_text(), target


def test_every_documented_setting_exists() -> None:
    from demo_service import DemoSettings

    documented = set(re.findall(r"`DEMO_([A-Z0-9_]+)`", (ROOT / "docs" / "demo.md").read_text()))
    fields = {name.upper() for name in DemoSettings.model_fields}
    assert documented and documented <= fields, documented - fields
    assert fields - {"MODEL_PATH"} <= documented, fields - documented  # and every setting is documented
