"""Batch jobs (the OpenAI Batch API), run through the edge by a separate, resumable process."""

from .runner import run_worker
from .worker import Worker

__all__ = ["Worker", "run_worker"]
