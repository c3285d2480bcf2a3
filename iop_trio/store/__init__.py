"""SQLite persistence: run history (node and edge) and registration tokens."""

from .history import RunHistory, RunRecorder
from .runs import FINAL_STATUSES, RunOutcome, RunStore
from .sqlite import Database

__all__ = ["FINAL_STATUSES", "Database", "RunHistory", "RunOutcome", "RunRecorder", "RunStore"]
