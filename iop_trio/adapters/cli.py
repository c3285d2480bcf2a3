"""The cli adapter: runs a local program per request and streams its stdout as the answer.

The program is given as an argv list (never a shell string, so a prompt cannot inject shell
syntax). The prompt goes to its stdin, or into its arguments where one contains ``{prompt}``;
``{model}`` becomes the backend model name. Each run starts the program in a new session, so it
leads its own process group and everything it spawns can be signalled at once: when the run is
cancelled or times out the group gets SIGTERM, then SIGKILL after ``kill_grace``; when the program
exits by itself, whatever it left behind in the group is killed, because nothing a request
started may outlive it.

Tokens are counted as whitespace-separated words, since a program's output carries no usage.
"""

from __future__ import annotations

import codecs
import math
import os
import re
import signal
import subprocess

import trio
from attrs import field, frozen
from attrs.validators import deep_iterable, ge, gt, instance_of, min_len, optional

from ..wire import Usage
from .base import BackendError, Capabilities, Completion, ExecutionSpec, RunSink, prompt_text

CHUNK_SIZE = 65536
#: How long to wait for the process to be reaped after SIGKILL (only a process stuck in the kernel
#: takes longer); cleanup runs shielded, so it needs a bound of its own.
REAP_BUDGET = 5.0
_PLACEHOLDER = re.compile(r"\{(prompt|model)\}")


def _argv_program_not_empty(_instance: object, _attribute: object, argv: tuple[str, ...]) -> None:
    if not argv[0]:
        raise ValueError("argv[0] must name a program")


@frozen
class CliOptions:
    argv: tuple[str, ...] = field(
        validator=[
            deep_iterable(instance_of(str), instance_of(tuple)),
            min_len(1),
            _argv_program_not_empty,
        ]
    )
    env: dict[str, str] = field(factory=dict)
    cwd: str | None = None
    #: Seconds for the whole run, process start to exit; None leaves it to the run's deadline.
    timeout: float | None = field(default=None, validator=optional(gt(0)))
    kill_grace: float = field(default=2.0, validator=ge(0))
    max_stderr_tail: int = field(default=4096, validator=ge(0))


@frozen
class CliAdapterConfig:
    """Everything about a program is per model, so there is nothing to configure at adapter level."""


def count_words(text: str) -> int:
    return len(text.split())


class WordCounter:
    """Counts the words that *begin* in each chunk of a stream.

    A word split across two reads counts once (in the chunk where it starts), and a chunk that is
    only whitespace or only the rest of a word counts 0, so the per-delta counts add up to the
    word count of the whole text.
    """

    def __init__(self) -> None:
        self.total = 0
        self._in_word = False

    def feed(self, text: str) -> int:
        words = count_words(text)
        if words and self._in_word and not text[0].isspace():
            words -= 1
        if text:
            self._in_word = not text[-1].isspace()
        self.total += words
        return words


def command(options: CliOptions, prompt: str, model: str) -> tuple[list[str], bytes]:
    """The argv to run and the bytes for its stdin: the prompt goes to exactly one of them."""
    values = {"prompt": prompt, "model": model}
    as_argument = any("{prompt}" in arg for arg in options.argv)
    # One pass per argument: text substituted in is never itself searched for placeholders.
    argv = [_PLACEHOLDER.sub(lambda match: values[match[1]], arg) for arg in options.argv]
    return argv, b"" if as_argument else prompt.encode("utf-8")


class CliAdapter:
    name = "cli"

    def __init__(self, config: CliAdapterConfig, models: dict[str, CliOptions]) -> None:
        self._models = models

    def capabilities(self) -> Capabilities:
        return Capabilities(models=tuple(self._models))

    async def discover_models(self) -> tuple[str, ...]:
        return ()  # a program cannot be asked what it serves: only configured models exist

    async def execute(self, spec: ExecutionSpec, sink: RunSink) -> Completion:
        options: CliOptions = spec.options or self._models[spec.model]
        prompt = prompt_text(spec)
        argv, stdin_data = command(options, prompt, spec.backend_model)
        if any("\0" in arg for arg in argv):
            raise BackendError("invalid_request", "the prompt contains a NUL character")
        prompt_words = count_words(prompt)
        sink.report_prompt_tokens(prompt_words)
        timeout = options.timeout if options.timeout is not None else math.inf
        with trio.move_on_after(timeout):
            returncode, words, stderr_tail = await self._run(argv, stdin_data, options, sink)
            if returncode == 0:
                return Completion("stop", Usage(prompt_words, words))
            raise _failure(returncode, stderr_tail)
        raise BackendError("backend_timeout", f"{argv[0]} did not finish within {timeout:g}s")

    async def _run(
        self, argv: list[str], stdin_data: bytes, options: CliOptions, sink: RunSink
    ) -> tuple[int, int, bytes]:
        """Run the program to its exit; stop it and its group on the way out, however it goes."""
        try:
            process = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env={**os.environ, **options.env},
                cwd=options.cwd,
            )
        except FileNotFoundError as exc:
            raise BackendError(
                "backend_unavailable", f"cannot start {argv[0]}: not found ({exc})"
            ) from exc
        except OSError as exc:
            raise BackendError("backend_unavailable", f"cannot start {argv[0]}: {exc}") from exc
        assert process.stdin and process.stdout and process.stderr
        await sink.started()
        stderr_tail = bytearray()
        try:
            # stdin, stdout and stderr are served at once: a program may fill one pipe while we
            # would otherwise be blocked on another.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_feed, process.stdin, stdin_data)
                nursery.start_soon(_keep_tail, process.stderr, stderr_tail, options.max_stderr_tail)
                nursery.start_soon(_reap, process)
                words = await _stream(process.stdout, sink)
        except ExceptionGroup as group:
            # The helper tasks never fail, so this is the sink's own error (say, the edge
            # connection closed): the node core expects it as the port promises, not wrapped.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process, options.kill_grace)
        returncode = process.returncode
        assert returncode is not None  # _reap saw it exit before the nursery could close
        return returncode, words, bytes(stderr_tail)

    async def aclose(self) -> None:
        pass  # every run's process group is gone by the time execute returns


async def _feed(stdin: trio.abc.SendStream, data: bytes) -> None:
    """Write the prompt, then close stdin so the program sees its end (argument mode: at once)."""
    async with stdin:
        if data:
            try:
                await stdin.send_all(data)
            except trio.BrokenResourceError:
                pass  # the program closed its stdin or exited without reading it all: its choice


async def _keep_tail(stderr: trio.abc.ReceiveStream, tail: bytearray, limit: int) -> None:
    """Drain stderr (a program blocked on a full pipe never exits), keeping its last bytes."""
    while chunk := await stderr.receive_some(CHUNK_SIZE):
        tail += chunk
        del tail[: max(0, len(tail) - limit)]


async def _reap(process: trio.Process) -> None:
    await process.wait()
    # Anything still in the group would outlive the request and hold our pipes open, so the
    # output streams would never end: kill it now rather than when the run ends. (A descendant
    # that started a session of its own escapes this; the run's timeout or deadline bounds it.)
    _signal_group(process, signal.SIGKILL)


async def _stream(stdout: trio.abc.ReceiveStream, sink: RunSink) -> int:
    """Forward stdout as it arrives; return the number of words."""
    # Incremental, so a multi-byte character split across two reads is decoded whole.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    counter = WordCounter()
    while True:
        chunk = await stdout.receive_some(CHUNK_SIZE)
        text = decoder.decode(chunk, final=not chunk)
        if text:
            await sink.delta(text, counter.feed(text))
        if not chunk:
            return counter.total


async def _stop(process: trio.Process, kill_grace: float) -> None:
    """SIGTERM the group, give it ``kill_grace`` to exit, then SIGKILL whatever is left.

    Called shielded from a ``finally``; every wait is bounded, so cancellation stays prompt.
    """
    if process.returncode is None:
        _signal_group(process, signal.SIGTERM)
        with trio.move_on_after(kill_grace):
            await process.wait()
    # Always: a grandchild may ignore SIGTERM, or outlive a leader that obeyed it.
    _signal_group(process, signal.SIGKILL)
    with trio.move_on_after(REAP_BUDGET):
        await process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            await stream.aclose()


def _signal_group(process: trio.Process, signum: signal.Signals) -> None:
    # The group id is the leader's pid (start_new_session); the kernel does not reuse a pid while
    # a process group of that id still has members.
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass  # the group is empty: everything has exited already
    except PermissionError:
        pass  # some systems (macOS) say so for a group holding only zombies


def _failure(returncode: int, stderr_tail: bytes) -> BackendError:
    if returncode < 0:
        try:
            how = f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exit status {returncode}"
    tail = stderr_tail.decode("utf-8", errors="replace").strip()
    return BackendError("backend_error", f"{how}: {tail}" if tail else how)
