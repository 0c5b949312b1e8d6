"""Warm start (docs/admission.md, "Warm start"): learned lengths saved by one process and restored
by the next, under a conservative rule (the same model, no older than a day, this format); the
restart behind vLLM is in test_vllm_admission.py."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from gpu_asgi import OutputLengths
from gpu_asgi._estimate.lengths_file import FORMAT, LengthsFile


def taught(answers: int = 40) -> OutputLengths:
    """Two routes, a tenant and an answer cut at its limit, in two bands of declared limits."""
    lengths = OutputLengths(0.9)
    for i in range(answers):
        lengths.observe(20 + i, "POST /chat", limit=400)
        lengths.observe(5 + i % 7, "POST /chat", "acme", limit=400)
        lengths.observe(100, "POST /complete", limit=128, truncated=i % 10 == 0)
    return lengths


def same_answers(a: OutputLengths, b: OutputLengths) -> None:
    for limit, route, tenant in ((400, "POST /chat", None), (400, "POST /chat", "acme"), (128, "POST /complete", None),
                                 (2048, "POST /chat", None)):
        assert a.predict(limit, route, tenant) == b.predict(limit, route, tenant)
        assert a.survival(10, 30, limit, route, tenant) == b.survival(10, 30, limit, route, tenant)
    assert a.statistics() == b.statistics()


def test_a_snapshot_restored_predicts_what_the_original_does() -> None:
    original = taught()
    rows = json.loads(json.dumps(original.snapshot()))  # through JSON, as a file holds it
    assert any(None in row[3] for row in rows)  # an answer cut at its limit stays "at least its limit"
    restored = OutputLengths(0.9)
    assert restored.restore(rows) == 160  # the route's 80 (acme's among them), acme's 40, the other route's 40
    same_answers(original, restored)
    assert restored.predict(400, "POST /chat") < 400  # warm: not the limit


def test_restore_keeps_the_last_window_of_each_key() -> None:
    small = OutputLengths(0.5, window=16, min_samples=4)
    assert small.restore([["POST /chat", None, 9, [1000] * 100 + [10] * 16]]) == 16
    assert small.predict(400, "POST /chat") == 10


@pytest.mark.parametrize(
    "rows",
    [[["POST /chat", None, 9]], [[1, None, 9, [1]]], [["r", None, 9, [-1]]], [["r", None, 9, ["x"]]], [["r", None, 99, [1]]],
     [["r", None, True, [1]]]],
)
def test_rows_of_another_shape_are_refused_and_nothing_is_learnt(rows: list[list[object]]) -> None:
    lengths = OutputLengths(0.9)
    with pytest.raises((ValueError, TypeError)):
        lengths.restore(rows)
    assert lengths.snapshot() == []


def test_the_file_restores_a_new_process_of_the_same_model(tmp_path: Path) -> None:
    path = tmp_path / "lengths" / "tiny.json"
    original = taught()
    LengthsFile(path, original, model="tiny").save()
    assert [p.name for p in path.parent.iterdir()] == ["tiny.json"]  # written whole: no temporary left
    fresh = OutputLengths(0.9)
    assert LengthsFile(path, fresh, model="tiny").load() == 160
    same_answers(original, fresh)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"model": "other"}, "written for model 'other'"),
        ({"saved_at": 0.0}, "older than"),
        ({"saved_at": 4e9}, "from the future"),
        ({"format": FORMAT + 1}, "not a learned-lengths file"),
        ({"lengths": [["r", None, 9, [-5]]]}, "not a learned-lengths row"),
    ],
)
def test_a_file_that_does_not_fit_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict[str, object], why: str
) -> None:
    path = tmp_path / "tiny.json"
    LengthsFile(path, taught(), model="tiny").save()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **change}))
    fresh = OutputLengths(0.9)
    with caplog.at_level(logging.WARNING, logger="gpu_asgi.lengths"):
        assert LengthsFile(path, fresh, model="tiny").load() == 0
    assert why in caplog.text and "starting cold" in caplog.text
    assert fresh.predict(400, "POST /chat") == 400  # cold: the limit


def test_a_missing_or_broken_file_is_a_cold_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fresh = OutputLengths(0.9)
    assert LengthsFile(tmp_path / "none.json", fresh, model="tiny").load() == 0
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": 1, "mod')
    with caplog.at_level(logging.WARNING, logger="gpu_asgi.lengths"):
        assert LengthsFile(broken, fresh, model="tiny").load() == 0
    assert "not read" in caplog.text
    assert fresh.snapshot() == []


async def test_it_saves_on_a_timer_and_when_it_stops(tmp_path: Path) -> None:
    import asyncio

    path = tmp_path / "tiny.json"
    lengths = OutputLengths(0.9)
    store = LengthsFile(path, lengths, model="tiny", interval=0.05)
    store.start()
    lengths.observe(7, "POST /chat", limit=400)
    for _ in range(100):
        if path.exists():
            break
        await asyncio.sleep(0.02)
    assert json.loads(path.read_text())["lengths"] == [["POST /chat", None, 9, [7.0]]]
    lengths.observe(8, "POST /chat", limit=400)
    await store.stop()
    saved = json.loads(path.read_text())
    assert saved["lengths"] == [["POST /chat", None, 9, [7.0, 8.0]]] and saved["model"] == "tiny"
    assert math.isfinite(saved["saved_at"])
