"""The demo's settings and start-up, as a new user meets them: environment, flags, folders, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic_settings import CliApp

from demo_service import DemoSettings


@pytest.mark.parametrize("status", [429, 503])
def test_reject_status_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    monkeypatch.setenv("DEMO_REJECT_STATUS", str(status))
    assert DemoSettings().reject_status == status


def test_reject_status_comes_from_the_command_line() -> None:
    assert CliApp.run(DemoSettings, cli_args=["--reject-status", "429"]).reject_status == 429


@pytest.mark.parametrize("value", ["404", "soon", "429.5"])
def test_other_reject_statuses_are_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DEMO_REJECT_STATUS", value)
    with pytest.raises(ValueError, match="429 or 503"):
        DemoSettings()


def test_local_model_dir_is_a_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DEMO_LOCAL_MODEL_DIR", str(tmp_path / "m"))
    assert DemoSettings().local_model_dir == tmp_path / "m"


def test_help_parses_arguments_before_importing_torch() -> None:
    # What makes --help fast, asserted without timing it: torch and transformers stay unimported.
    script = (
        "import runpy, sys\n"
        "sys.argv = ['demo_service', '--help']\n"
        "try:\n"
        "    runpy.run_module('demo_service', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        "heavy = sorted({'torch', 'transformers', 'uvicorn', 'fastapi'} & set(sys.modules))\n"
        "print('heavy:', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "--model-path" in result.stdout and "--reject-status {429,503}" in result.stdout
    assert result.stdout.rstrip().endswith("heavy: []")


def test_a_folder_with_other_files_is_refused_before_any_work(tmp_path: Path) -> None:
    from demo_service._model.local import ModelDirInUse, ensure_local_model

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ModelDirInUse, match=r"holds other files but no model.*DEMO_LOCAL_MODEL_DIR"):
        ensure_local_model(tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.tmp-")]


def test_the_command_line_says_what_is_wrong_with_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from demo_service.__main__ import main

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit:
        main(["--local-model-dir", str(tmp_path), "--no-progress"])
    assert isinstance(exit.value.code, str) and exit.value.code.startswith(f"error: {tmp_path} holds other files")
    assert "checking the tiny local model" in capsys.readouterr().err  # the start-up log says what it does
