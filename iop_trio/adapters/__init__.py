"""Adapters: the backends a node can drive (mock now; cli, ollama, vllm alongside)."""

from .base import (
    Adapter,
    BackendError,
    Capabilities,
    Completion,
    ExecutionSpec,
    RunSink,
)
from .registry import ADAPTERS, AdapterEntry

__all__ = [
    "ADAPTERS",
    "Adapter",
    "AdapterEntry",
    "BackendError",
    "Capabilities",
    "Completion",
    "ExecutionSpec",
    "RunSink",
]
