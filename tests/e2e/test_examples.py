"""The example configs work as they stand: examples/node.yaml serves its four adapters side by side."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from .conftest import Cluster, Process, iop_trio

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_example_node_serves_mock_ollama_openai_and_cli_models(tmp_path) -> None:
    ollama = Process("ollama", iop_trio_double("ollama", "llama3.2"), tmp_path)
    vllm = Process("vllm", iop_trio_double("openai", "Qwen/Qwen2.5-0.5B-Instruct"), tmp_path)
    cluster = Cluster(tmp_path)
    try:
        ollama_url, vllm_url = ollama.wait_ready()["url"], vllm.wait_ready()["url"]
        cluster.start_edge()
        example = yaml.safe_load((EXAMPLES / "node.yaml").read_text())
        example["adapters"]["ollama"]["base_url"] = ollama_url
        example["adapters"]["vllm"]["base_url"] = vllm_url
        config = cluster.node_config("node-a", example.pop("models"), adapters=example["adapters"],
                                     labels=example["labels"], capacity=example["capacity"])
        cluster.start("node-a", iop_trio("node", "--config", str(config)))
        cluster.wait_for_models("mock", "llama3.2", "qwen2.5-0.5b", "shout")
        client = cluster.client()
        answers = {
            model: client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "quiet words here"}], max_tokens=3
            )
            for model in ("mock", "llama3.2", "qwen2.5-0.5b", "shout")
        }
        assert answers["llama3.2"].choices[0].message.content == "alpha bravo charlie"
        assert answers["qwen2.5-0.5b"].choices[0].message.content == "alpha bravo charlie"
        assert answers["shout"].choices[0].message.content.split() == ["QUIET", "WORDS", "HERE"]
        assert len(answers["mock"].choices[0].message.content.split()) == 3
        history = cluster.wait_for_ended_runs("node-a", 4)
        assert {row["status"] for row in history} == {"complete"}
        assert {row["adapter"] for row in history} == {"mock", "ollama", "vllm", "cli"}
    finally:
        try:
            cluster.stop()
        finally:
            ollama.stop()
            vllm.stop()


def iop_trio_double(kind: str, model: str) -> list[str]:
    return [*iop_trio()[:1], "-m", "tests.doubles", kind, "--model", model]


def test_example_edge_config_loads_and_names_its_files() -> None:
    from iop_trio.config import EdgeConfig, NodeSettings, load_config
    from iop_trio.node.router import Router

    edge = load_config(EXAMPLES / "edge.yaml", EdgeConfig)
    assert edge.tls.enabled and edge.tls.ca == "certs/ca.crt"
    node = load_config(EXAMPLES / "node.yaml", NodeSettings)
    router = Router.from_settings(node, "examples/node.yaml")
    assert set(router.models) == {"mock", "llama3.2", "qwen2.5-0.5b", "shout"}
    assert router.adapter_names == ("cli", "mock", "ollama", "vllm")
