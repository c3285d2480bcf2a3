"""worker.yaml: the example works next to the example edge, and the schema is strict."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from iop_trio.config import ConfigError, EdgeConfig, WorkerConfig, load_config
from iop_trio.worker import run_worker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_example_worker_serves_the_example_edge() -> None:
    worker = load_config(EXAMPLES / "worker.yaml", WorkerConfig)
    edge = load_config(EXAMPLES / "edge.yaml", EdgeConfig)
    assert worker.data_dir == edge.data_dir, "the worker shares the edge's store"
    assert worker.edge_url == f"http://{edge.http.listen}"
    assert worker.api_key == "" and not edge.api_keys
    assert worker == WorkerConfig(), "the example spells out the defaults"


def test_an_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "worker.yaml"
    path.write_text("")
    assert load_config(path, WorkerConfig) == WorkerConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour: red\n", "extra fields found (colour)"),
        ("concurrency: 0\n", "concurrency"),
        ("lease_ttl: '30'\n", "lease_ttl"),
        ("log_level: loud\n", "log_level"),
    ],
)
def test_a_bad_key_or_value_names_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="worker.yaml") as info:
        load_config(path, WorkerConfig)
    assert message in str(info.value)


async def test_a_worker_refuses_a_data_dir_without_an_edge_database(tmp_path: Path) -> None:
    config = WorkerConfig(data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="no edge database"):
        await run_worker(config, trio.sleep_forever)
    assert not (tmp_path / "nowhere").exists()
