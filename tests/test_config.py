"""Strict YAML config loading, token resolution, HOST:PORT parsing and node model routing."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_trio.adapters.mock import MockOptions
from iop_trio.config import (
    ConfigError,
    EdgeConfig,
    HttpConfig,
    ModelConfig,
    NodeSettings,
    load_config,
    parse_host_port,
)
from iop_trio.node.router import Router, UnknownModel
from iop_trio.transport.tls import TlsConfig
from iop_trio.wire import RunRequest, SamplingParams


def write(tmp_path: Path, text: str, name: str = "edge.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(path: Path, cls: type) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, cls)
    return str(info.value)


# --- load_config --------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_empty_file_gives_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text), EdgeConfig) == EdgeConfig()
    assert load_config(write(tmp_path, text, "node.yaml"), NodeSettings) == NodeSettings()


def test_defaults_are_safe() -> None:
    edge = EdgeConfig()
    assert edge.tls.enabled is True
    assert edge.api_keys == ()
    assert edge.http.listen.startswith("127.0.0.1:")
    assert edge.database == Path(edge.data_dir) / "edge.db"
    node = NodeSettings()
    assert node.tls.enabled is True
    assert node.models == ()
    assert node.database == Path(node.data_dir) / "runs.db"


def test_edge_values_are_loaded(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
http:
  listen: 0.0.0.0:9000
  graceful_timeout: 5
tls:
  enabled: false
api_keys: [k1, k2]
nodes:
  max_concurrency: 8
run_deadline: 0
""",
    )
    edge = load_config(path, EdgeConfig)
    assert edge.http == HttpConfig(listen="0.0.0.0:9000", graceful_timeout=5.0)
    assert isinstance(edge.http.graceful_timeout, float)
    assert edge.tls == TlsConfig(enabled=False)
    assert tuple(key.key for key in edge.api_keys) == ("k1", "k2")  # plain strings: keys without limits
    assert all(key.requests_per_minute == 0 and not key.models for key in edge.api_keys)
    assert edge.nodes.max_concurrency == 8
    assert edge.nodes.heartbeat_interval == 30.0  # untouched default
    assert edge.run_deadline == 0.0


def test_node_values_are_loaded(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
node_id: gpu-1
edge: edge.example:7070
token: iop_a.b
capacity: 4
labels: {zone: eu}
models:
  - name: small
    adapter: mock
    options: {tokens: 3}
  - name: big
    adapter: mock
    backend_model: big-v2
""",
        "node.yaml",
    )
    node = load_config(path, NodeSettings)
    assert node.node_id == "gpu-1"
    assert node.capacity == 4
    assert node.labels == {"zone": "eu"}
    assert node.models == (
        ModelConfig(name="small", adapter="mock", options={"tokens": 3}),
        ModelConfig(name="big", adapter="mock", backend_model="big-v2"),
    )
    # The node's TLS default is the node's own certificate, not the edge's.
    assert node.tls.cert == "certs/node.crt"


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "http: {listen: '127.0.0.1:1'}\ncolour: red\n")
    message = config_error(path, EdgeConfig)
    assert "edge.yaml" in message
    assert "colour" in message


def test_unknown_top_level_key_node(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "api_keys: [a]\n", "node.yaml"), NodeSettings)
    assert "node.yaml" in message
    assert "api_keys" in message


def test_unknown_nested_key(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "tls:\n  enabled: true\n  colour: blue\n"), EdgeConfig)
    assert "edge.yaml" in message
    assert "colour" in message
    assert "tls" in message


@pytest.mark.parametrize(
    ("cls", "text", "key"),
    [
        (NodeSettings, "capacity: '5'", "capacity"),
        (NodeSettings, "capacity: 5.5", "capacity"),
        (NodeSettings, "capacity: true", "capacity"),
        (EdgeConfig, "api_keys: abc", "api_keys"),
        (EdgeConfig, "api_keys: [1, 2]", "api_keys"),
        (EdgeConfig, "tls: {enabled: 'yes'}", "enabled"),
        (EdgeConfig, "tls: {enabled: 1}", "enabled"),
        (EdgeConfig, "tls: true", "tls"),
        (EdgeConfig, "http: {listen: 8080}", "listen"),
        (EdgeConfig, "cancel_timeout: soon", "cancel_timeout"),
        (NodeSettings, "labels: [a, b]", "labels"),
        (NodeSettings, "labels: {zone: 1}", "labels"),
        (NodeSettings, "models: {name: a, adapter: mock}", "models"),
        (NodeSettings, "models: [{name: a}]", "adapter"),
    ],
)
def test_wrong_types_are_rejected(tmp_path: Path, cls: type, text: str, key: str) -> None:
    message = config_error(write(tmp_path, text + "\n", "conf.yaml"), cls)
    assert "conf.yaml" in message
    assert key in message


def test_error_in_a_list_item_names_the_item(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  - {name: a, adapter: mock}\n  - {name: b}\n", "node.yaml")
    message = config_error(path, NodeSettings)
    assert "node.yaml" in message
    assert "adapter" in message


def test_error_in_a_list_item_names_the_index(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  - {name: a, adapter: mock}\n  - {name: b}\n", "node.yaml")
    message = config_error(path, NodeSettings)
    assert "models[1]" in message


def test_not_yaml(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "http: [unclosed\n  listen: {\n"), EdgeConfig)
    assert "edge.yaml" in message
    assert "YAML" in message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    message = config_error(write(tmp_path, text), EdgeConfig)
    assert "edge.yaml" in message
    assert "mapping" in message


def test_missing_file(tmp_path: Path) -> None:
    message = config_error(tmp_path / "absent.yaml", EdgeConfig)
    assert "absent.yaml" in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    (tmp_path / "dir.yaml").mkdir()
    message = config_error(tmp_path / "dir.yaml", EdgeConfig)
    assert "dir.yaml" in message


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# --- NodeSettings.resolve_token -----------------------------------------------------------


def test_resolve_token_inline() -> None:
    assert NodeSettings(token="iop_a.b").resolve_token() == "iop_a.b"


def test_resolve_token_from_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  iop_a.secret\n\n")
    assert NodeSettings(token_file=str(token_file)).resolve_token() == "iop_a.secret"


def test_inline_token_wins_over_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("iop_file.secret\n")
    settings = NodeSettings(token="iop_inline.secret", token_file=str(token_file))
    assert settings.resolve_token() == "iop_inline.secret"


def test_resolve_token_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token_file"):
        NodeSettings(token_file=str(tmp_path / "missing")).resolve_token()


def test_resolve_token_neither() -> None:
    with pytest.raises(ConfigError, match="token"):
        NodeSettings().resolve_token()


# --- parse_host_port ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("localhost:7070", ("localhost", 7070)),
        ("edge.example.com:443", ("edge.example.com", 443)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        (":9000", ("127.0.0.1", 9000)),
        ("[::1]:8443", ("::1", 8443)),
        ("[::]:80", ("::", 80)),
    ],
)
def test_parse_host_port_good(value: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(value, "http.listen") == expected


@pytest.mark.parametrize(
    "value",
    ["", "8080", "localhost", "localhost:", "localhost:http", "host:-1", "host:80a", "host: 80"],
)
def test_parse_host_port_bad(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_host_port(value, "iop.listen")
    assert "iop.listen" in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["host:65536", "host:99999"])
def test_parse_host_port_rejects_out_of_range_port(value: str) -> None:
    with pytest.raises(ConfigError):
        parse_host_port(value, "iop.listen")


# --- Router.from_settings -----------------------------------------------------------------


def settings(*models: ModelConfig, **kwargs: object) -> NodeSettings:
    return NodeSettings(models=models, **kwargs)  # type: ignore[arg-type]


def test_router_builds_routes() -> None:
    router = Router.from_settings(
        settings(
            ModelConfig(name="small", adapter="mock", options={"tokens": 3, "ttft": 0.5}),
            ModelConfig(name="big", adapter="mock", backend_model="big-v2"),
        )
    )
    assert router.models == ("small", "big")
    assert router.adapter_names == ("mock",)
    route, spec = router.resolve(
        RunRequest(run_id="r1", model="small", params=SamplingParams(max_tokens=2))
    )
    assert route.options == MockOptions(tokens=3, ttft=0.5)
    assert spec.backend_model == "small"
    assert spec.options == route.options
    assert spec.params.max_tokens == 2
    _, big = router.resolve(RunRequest(run_id="r2", model="big"))
    assert big.backend_model == "big-v2"
    assert big.options == MockOptions()
    with pytest.raises(UnknownModel):
        router.resolve(RunRequest(run_id="r3", model="nope"))


def test_router_unknown_adapter() -> None:
    with pytest.raises(ConfigError) as info:
        Router.from_settings(
            settings(
                ModelConfig(name="a", adapter="nonexistent"),
            ),
            source="node.yaml",
        )
    message = str(info.value)
    assert "node.yaml" in message
    assert "models[0].adapter" in message
    assert "nonexistent" in message


def test_router_unknown_adapter_names_the_right_index() -> None:
    with pytest.raises(ConfigError, match=r"models\[1\]\.adapter"):
        Router.from_settings(
            settings(ModelConfig(name="a", adapter="mock"), ModelConfig(name="b", adapter="nope"))
        )


@pytest.mark.parametrize(
    ("options", "key"),
    [({"tokens": "many"}, "tokens"), ({"ttft": "fast"}, "ttft"), ({"colour": 1}, "colour")],
)
def test_router_wrong_mock_options(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Router.from_settings(
            settings(ModelConfig(name="a", adapter="mock", options=options)), source="node.yaml"
        )
    message = str(info.value)
    assert "node.yaml" in message
    assert "models[0].options" in message
    assert key in message


def test_router_duplicate_model_names() -> None:
    with pytest.raises(ConfigError) as info:
        Router.from_settings(
            settings(
                ModelConfig(name="same", adapter="mock"),
                ModelConfig(name="same", adapter="mock", options={"tokens": 2}),
            )
        )
    assert "same" in str(info.value)


def test_router_unknown_adapter_block() -> None:
    with pytest.raises(ConfigError, match="adapters"):
        Router.from_settings(
            settings(ModelConfig(name="a", adapter="mock"), adapters={"vllm2": {}})
        )


def test_router_from_yaml_file(tmp_path: Path) -> None:
    path = write(
        tmp_path, "models:\n  - {name: a, adapter: mock, options: {tokens: many}}\n", "node.yaml"
    )
    node = load_config(path, NodeSettings)  # options are only checked against the adapter later
    with pytest.raises(ConfigError, match=r"models\[0\]\.options"):
        Router.from_settings(node, source=str(path))
