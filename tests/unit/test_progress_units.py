"""A task's progress unit (Task.progress_unit) is one the status reports and the metrics count."""

from __future__ import annotations

from batchinf.ledger.status import PROGRESS_UNITS
from batchinf.metrics import PROGRESS
from batchinf.tasks import TASKS


def test_every_progress_unit_is_reported_and_counted() -> None:
    units = {t.progress_unit for t in TASKS.values()} - {None}
    assert units == set(PROGRESS_UNITS) == set(PROGRESS)
    assert TASKS["transcribe"].progress_unit == "audio_seconds" and TASKS["generate_image"].progress_unit == "steps"
