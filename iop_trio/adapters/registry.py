"""Adapter registry: one entry per adapter module. Adding an adapter is one line here.

Each entry names the adapter's config class (the node config's ``adapters.<name>`` block) and its
per-model options class (``models[].options``); both are structured strictly, so a typo in a
node's YAML is an error naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import frozen

from .base import Adapter
from .cli import CliAdapter, CliAdapterConfig, CliOptions
from .mock import MockAdapter, MockAdapterConfig, MockOptions
from .ollama import OllamaAdapter, OllamaConfig, OllamaOptions
from .vllm import VllmAdapter, VllmConfig, VllmOptions


@frozen
class AdapterEntry:
    config_type: type
    options_type: type
    factory: Callable[[Any, dict[str, Any]], Adapter]


ADAPTERS: dict[str, AdapterEntry] = {
    "mock": AdapterEntry(MockAdapterConfig, MockOptions, MockAdapter),
    "cli": AdapterEntry(CliAdapterConfig, CliOptions, CliAdapter),
    "ollama": AdapterEntry(OllamaConfig, OllamaOptions, OllamaAdapter),
    "vllm": AdapterEntry(VllmConfig, VllmOptions, VllmAdapter),
}
