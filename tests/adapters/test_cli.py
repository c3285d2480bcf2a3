"""The cli adapter, against real processes on the real clock.

Every test is bounded by ``trio.fail_after``. The programs are small Python scripts in
``scripts/`` run with this interpreter; the long-running ones write their pid to a file so a test
can check that nothing outlives a run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from iop_trio.adapters import ADAPTERS, BackendError, Completion, ExecutionSpec
from iop_trio.adapters.cli import CliAdapter, CliAdapterConfig, CliOptions, WordCounter, command
from iop_trio.config import ConfigError, ModelConfig, NodeSettings
from iop_trio.node.router import Router
from iop_trio.wire import ChatMessage, RunRequest, SamplingParams, Usage
from tests.adapters.sinks import RecordingSink

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable


def script(name: str, *args: str) -> tuple[str, ...]:
    return (PY, str(SCRIPTS / name), *args)


def spec(
    options: CliOptions,
    *,
    prompt: str = "hello cli world",
    kind: str = "completion",
    messages: tuple[ChatMessage, ...] = (),
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id="run-1",
        model="cli-model",
        backend_model="backend-x",
        kind=kind,  # type: ignore[arg-type]
        messages=messages,
        prompt=prompt,
        params=SamplingParams(),
        options=options,
    )


async def run(options: CliOptions, **kwargs: object) -> tuple[Completion, RecordingSink]:
    sink = RecordingSink()
    adapter = CliAdapter(CliAdapterConfig(), {"cli-model": options})
    completion = await adapter.execute(spec(options, **kwargs), sink)  # type: ignore[arg-type]
    return completion, sink


async def fails_with(options: CliOptions, **kwargs: object) -> tuple[BackendError, RecordingSink]:
    sink = RecordingSink()
    adapter = CliAdapter(CliAdapterConfig(), {"cli-model": options})
    with pytest.raises(BackendError) as info:
        await adapter.execute(spec(options, **kwargs), sink)  # type: ignore[arg-type]
    return info.value, sink


async def cancel_on_first_delta(options: CliOptions) -> float:
    """Run until the first delta, cancel the run's scope there; return how long the call took
    to come back after the cancel."""
    with trio.CancelScope() as scope:
        sink = RecordingSink(cancel=scope)
        await CliAdapter(CliAdapterConfig(), {"cli-model": options}).execute(spec(options), sink)
    assert scope.cancelled_caught
    return trio.current_time() - sink.deltas[0][0]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process; a zombie awaiting its reaper counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


async def gone_within(pid: int, seconds: float) -> bool:
    """A grandchild is reaped by whoever inherits it, so it may take a moment to disappear."""
    for _ in range(int(seconds / 0.02) + 1):
        if not alive(pid):
            return True
        await trio.sleep(0.02)
    return False


def read_pids(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()]


# --- streaming and prompts ----------------------------------------------------------------


async def test_streams_output_as_it_is_printed() -> None:
    with trio.fail_after(10):
        started = trio.current_time()
        completion, sink = await run(CliOptions(argv=script("slow_tokens.py", "6", "0.25")))
        ended = trio.current_time()
    assert sink.text == "w0 w1 w2 w3 w4 w5"
    # One delta per flushed word, the first long before the program finished.
    assert len(sink.deltas) >= 3
    assert ended - sink.deltas[0][0] > 0.9
    assert sink.deltas[0][0] - started < ended - started - 0.9
    assert completion == Completion("stop", Usage(prompt_tokens=3, completion_tokens=6))
    assert sink.tokens == 6
    assert sink.prompt_tokens == [3]


async def test_prompt_goes_to_stdin() -> None:
    with trio.fail_after(10):
        completion, sink = await run(
            CliOptions(argv=script("echo.py")), prompt="say something nice"
        )
    assert sink.text == "say something nice"
    assert completion.usage == Usage(3, 3)


async def test_chat_messages_go_to_stdin_one_per_line() -> None:
    messages = (ChatMessage("system", "be brief"), ChatMessage("user", "hi there"))
    with trio.fail_after(10):
        completion, sink = await run(
            CliOptions(argv=script("echo.py")), kind="chat", prompt="", messages=messages
        )
    assert sink.text == "be brief\nhi there"
    assert sink.prompt_tokens == [4]


async def test_prompt_and_model_as_arguments_and_stdin_closed() -> None:
    # echo.py copies stdin after its arguments: had stdin been left open it would never end.
    options = CliOptions(argv=script("echo.py", "--model={model}", "{prompt}"))
    with trio.fail_after(10):
        completion, sink = await run(options, prompt="a {model} b")
    # The prompt is substituted once and verbatim; the {model} inside it stays as it is.
    assert sink.text == "--model=backend-x a {model} b"
    assert completion.usage == Usage(3, 4)


def test_command_substitution() -> None:
    options = CliOptions(argv=("run", "-m", "{model}", "--prompt={prompt}!"))
    assert command(options, "x {prompt} y", "m1") == (
        ["run", "-m", "m1", "--prompt=x {prompt} y!"],
        b"",
    )
    assert command(CliOptions(argv=("run", "{model}")), "héllo", "m1") == (
        ["run", "m1"],
        "héllo".encode(),
    )


async def test_big_prompt_with_stderr_chatter_does_not_deadlock() -> None:
    # 1 MiB in through stdin, back out through stdout, and 256 KiB of stderr first: every pipe
    # is larger than its buffer, so only serving all three at once finishes.
    prompt = ("lorem ipsum dolor " * 60000)[: 1 << 20]
    options = CliOptions(argv=script("echo.py", "--stderr", str(256 * 1024)))
    with trio.fail_after(20):
        completion, sink = await run(options, prompt=prompt)
    assert sink.text == prompt
    assert completion.usage == Usage(len(prompt.split()), len(prompt.split()))
    assert sink.tokens == len(prompt.split())


async def test_program_that_does_not_read_its_stdin() -> None:
    options = CliOptions(argv=(PY, "-c", "print('ok')"))
    with trio.fail_after(10):
        completion, sink = await run(options, prompt="x " * (1 << 20))
    assert sink.text == "ok\n"
    assert completion.finish_reason == "stop"


async def test_multibyte_characters_split_across_reads() -> None:
    text = "héllo wörld ✓ 日本語 🎉"
    with trio.fail_after(10):
        completion, sink = await run(CliOptions(argv=script("drip_bytes.py", text)))
    assert sink.text == text
    assert "\ufffd" not in sink.text
    assert len(sink.deltas) > 5  # it really did arrive in pieces
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    assert sink.tokens == 5


async def test_invalid_utf8_is_replaced_not_fatal() -> None:
    code = "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe done \\xe2\\x9c')"
    with trio.fail_after(10):
        completion, sink = await run(CliOptions(argv=(PY, "-c", code)))
    assert sink.text == "ok \ufffd\ufffd done \ufffd"
    assert completion.finish_reason == "stop"


async def test_env_and_cwd(tmp_path: Path) -> None:
    code = "import os; print(os.environ['IOP_CLI_TEST'], os.environ['PATH'] != '', os.getcwd())"
    options = CliOptions(argv=(PY, "-c", code), env={"IOP_CLI_TEST": "set"}, cwd=str(tmp_path))
    with trio.fail_after(10):
        _, sink = await run(options)
    assert sink.text == f"set True {tmp_path}\n"


def test_word_counter_counts_words_where_they_start() -> None:
    counter = WordCounter()
    pieces = ["hel", "lo wo", "rld", "  ", " again", "\n", "x"]
    counts = [counter.feed(piece) for piece in pieces]
    assert counts == [1, 1, 0, 0, 1, 0, 1]
    assert counter.total == len("".join(pieces).split()) == 4


# --- failures -----------------------------------------------------------------------------


async def test_nonzero_exit_is_a_backend_error_with_the_stderr_tail() -> None:
    options = CliOptions(argv=script("fails.py"), max_stderr_tail=64)
    with trio.fail_after(10):
        error, sink = await fails_with(options)
    assert error.code == "backend_error"
    assert error.message.startswith("exit status 3: ")
    assert error.message.endswith("the real reason: model file is corrupt")
    assert len(error.message) < 100  # only the tail was kept
    assert sink.text == "partial output"  # what came before the failure was still streamed


async def test_killed_by_a_signal_says_which() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with trio.fail_after(10):
        error, _ = await fails_with(CliOptions(argv=(PY, "-c", code)))
    assert error.code == "backend_error"
    assert error.message == "killed by signal SIGKILL"


@pytest.mark.parametrize("program", ["iop-trio-no-such-program", "/nonexistent/bin/model"])
async def test_missing_program_is_unavailable(program: str) -> None:
    with trio.fail_after(10):
        error, sink = await fails_with(CliOptions(argv=(program, "{prompt}")))
    assert error.code == "backend_unavailable"
    assert "not found" in error.message
    assert program in error.message
    assert sink.deltas == []


async def test_missing_cwd_is_unavailable(tmp_path: Path) -> None:
    options = CliOptions(argv=script("echo.py"), cwd=str(tmp_path / "missing"))
    with trio.fail_after(10):
        error, _ = await fails_with(options)
    assert error.code == "backend_unavailable"


async def test_nul_in_an_argument_prompt_is_an_invalid_request() -> None:
    with trio.fail_after(10):
        error, _ = await fails_with(CliOptions(argv=script("echo.py", "{prompt}")), prompt="a\0b")
    assert error.code == "invalid_request"


# --- timeouts, cancellation and cleanup ---------------------------------------------------


async def test_timeout_stops_the_program(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    options = CliOptions(argv=script("slow_tokens.py", "100", "0.1", str(pidfile)), timeout=1.0)
    with trio.fail_after(10):
        started = trio.current_time()
        error, sink = await fails_with(options)
        elapsed = trio.current_time() - started
    assert error.code == "backend_timeout"
    assert "1s" in error.message
    assert 1.0 <= elapsed < 2.0  # SIGTERM ended it at once; no kill_grace wait
    assert sink.deltas  # it had been streaming
    (pid,) = read_pids(pidfile)
    assert not alive(pid)


async def test_cancel_stops_a_cooperative_program_at_once(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    options = CliOptions(argv=script("slow_tokens.py", "100", "0.1", str(pidfile)), kill_grace=30)
    with trio.fail_after(10):
        elapsed = await cancel_on_first_delta(options)
    assert elapsed < 1.0
    (pid,) = read_pids(pidfile)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_cancel_kills_a_program_that_ignores_sigterm(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    options = CliOptions(argv=script("ignores_sigterm.py", str(pidfile)), kill_grace=0.5)
    with trio.fail_after(10):
        elapsed = await cancel_on_first_delta(options)
    assert 0.5 <= elapsed < 1.5  # it waited out the grace, then SIGKILL
    (pid,) = read_pids(pidfile)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_cancel_kills_the_grandchildren(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    options = CliOptions(argv=script("spawns_child.py", str(pidfile)))
    with trio.fail_after(10):
        elapsed = await cancel_on_first_delta(options)
        pid, grandchild = read_pids(pidfile)
        assert not alive(pid)
        assert await gone_within(grandchild, 2.0)
    assert elapsed < 1.0


async def test_grandchild_left_behind_after_a_normal_exit_is_killed(tmp_path: Path) -> None:
    # The grandchild holds our stdout open: without the group kill the run would never end.
    pidfile = tmp_path / "pids"
    options = CliOptions(argv=script("spawns_child.py", str(pidfile), "--exit"))
    with trio.fail_after(10):
        completion, sink = await run(options)
        _, grandchild = read_pids(pidfile)
        assert await gone_within(grandchild, 2.0)
    assert sink.text == "spawned"
    assert completion.finish_reason == "stop"


class SinkFailed(Exception):
    pass


async def test_a_failing_sink_stops_the_program_and_its_error_comes_out_bare(
    tmp_path: Path,
) -> None:
    # Say the edge connection closed while forwarding a delta: the node core must see that error
    # itself (not wrapped in an ExceptionGroup), and the program must not be left running.
    class FailingSink(RecordingSink):
        async def delta(self, text: str, tokens: int = 1) -> None:
            raise SinkFailed("connection closed")

    pidfile = tmp_path / "pid"
    options = CliOptions(argv=script("slow_tokens.py", "100", "0.1", str(pidfile)))
    with trio.fail_after(10):
        with pytest.raises(SinkFailed):
            await CliAdapter(CliAdapterConfig(), {}).execute(spec(options), FailingSink())
    (pid,) = read_pids(pidfile)
    assert not alive(pid)


async def test_many_runs_at_once(tmp_path: Path) -> None:
    results: dict[int, str] = {}

    async def one(index: int) -> None:
        _, sink = await run(CliOptions(argv=script("echo.py", "{prompt}")), prompt=f"run {index}")
        results[index] = sink.text

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for index in range(10):
                nursery.start_soon(one, index)
    assert results == {index: f"run {index}" for index in range(10)}


# --- configuration ------------------------------------------------------------------------


async def test_registered_and_capabilities() -> None:
    entry = ADAPTERS["cli"]
    assert entry.config_type is CliAdapterConfig
    assert entry.options_type is CliOptions
    built = entry.factory(CliAdapterConfig(), {"a": CliOptions(argv=("x",))})
    assert built.name == "cli"
    assert built.capabilities().models == ("a",)
    assert await built.discover_models() == ()
    await built.aclose()


def cli_router(options: dict[str, object]) -> Router:
    settings = NodeSettings(models=(ModelConfig(name="a", adapter="cli", options=options),))
    return Router.from_settings(settings, source="node.yaml")


def test_options_from_config() -> None:
    router = cli_router(
        {"argv": ["llama-cli", "-m", "{model}", "-p", "{prompt}"], "env": {"A": "1"}, "timeout": 30}
    )
    route, _ = router.resolve(RunRequest(run_id="r", model="a"))
    assert route.options == CliOptions(
        argv=("llama-cli", "-m", "{model}", "-p", "{prompt}"), env={"A": "1"}, timeout=30.0
    )
    assert route.options.kill_grace == 2.0
    assert route.options.max_stderr_tail == 4096


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"argv": "echo hi"}, "argv"),  # a shell string, not a list
        ({"argv": ["echo", 1]}, "argv[1]"),
        ({}, "argv"),
        ({"argv": ["echo"], "env": {"A": 1}}, "env"),
        ({"argv": ["echo"], "env": "A=1"}, "env"),
        ({"argv": ["echo"], "timeout": "5s"}, "timeout"),
        ({"argv": ["echo"], "shell": True}, "shell"),
    ],
)
def test_wrong_options_are_config_errors_naming_the_key(
    options: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        cli_router(options)
    message = str(info.value)
    assert "node.yaml" in message
    assert "models[0].options" in message
    assert key in message


@pytest.mark.parametrize(
    "options",
    [
        {"argv": []},
        {"argv": [""]},
        {"argv": ["echo"], "timeout": 0},
        {"argv": ["echo"], "kill_grace": -1},
        {"argv": ["echo"], "max_stderr_tail": -1},
    ],
)
def test_bad_option_values_are_config_errors(options: dict[str, object]) -> None:
    # The shared describe_error reports an attrs validator's failure as "invalid value @ $",
    # without the validator's message, so only the location is checked here.
    with pytest.raises(ConfigError, match=r"node\.yaml: models\[0\]\.options"):
        cli_router(options)


@pytest.mark.parametrize("argv", [(), ("",), "echo hi", ["echo", "hi"]])
def test_options_validate_when_built_in_code(argv: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        CliOptions(argv=argv)  # type: ignore[arg-type]
