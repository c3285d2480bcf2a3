"""The mock adapter: a deterministic, timed token stream with injectable failures."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from iop_trio.adapters import ADAPTERS, BackendError, Completion, ExecutionSpec
from iop_trio.adapters.mock import WORDS, MockAdapter, MockAdapterConfig, MockOptions
from iop_trio.wire import ChatMessage, SamplingParams, Usage
from tests.adapters.sinks import RecordingSink


def spec(
    options: MockOptions | None = None,
    *,
    prompt: str = "hello mock world",
    kind: str = "completion",
    messages: tuple[ChatMessage, ...] = (),
    max_tokens: int | None = None,
    stop: tuple[str, ...] = (),
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id="run-1",
        model="mock-model",
        backend_model="mock-model",
        kind=kind,  # type: ignore[arg-type]
        messages=messages,
        prompt=prompt,
        params=SamplingParams(max_tokens=max_tokens, stop=stop),
        options=options,
    )


def adapter() -> MockAdapter:
    return MockAdapter(MockAdapterConfig(), {"mock-model": MockOptions()})


async def run(execution: ExecutionSpec) -> tuple[Completion, RecordingSink]:
    sink = RecordingSink()
    completion = await adapter().execute(execution, sink)
    return completion, sink


def test_registered_and_capabilities() -> None:
    entry = ADAPTERS["mock"]
    assert entry.options_type is MockOptions
    assert entry.config_type is MockAdapterConfig
    built = entry.factory(MockAdapterConfig(), {"a": MockOptions(), "b": MockOptions(tokens=2)})
    assert built.name == "mock"
    assert built.capabilities().models == ("a", "b")


async def test_streams_the_configured_number_of_tokens(autojump_clock: MockClock) -> None:
    completion, sink = await run(spec(MockOptions(tokens=7)))
    assert len(sink.deltas) == 7
    assert all(tokens == 1 for _, _, tokens in sink.deltas)
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage(prompt_tokens=3, completion_tokens=7)
    assert sink.prompt_tokens == [3]
    # Words from the fixed list, space-separated, no leading or trailing space.
    words = sink.text.split(" ")
    assert len(words) == 7
    assert all(word in WORDS for word in words)
    assert sink.deltas[0][1] == words[0]
    assert all(text.startswith(" ") for _, text, _ in sink.deltas[1:])


async def test_default_options(autojump_clock: MockClock) -> None:
    completion, sink = await run(spec(None))
    assert len(sink.deltas) == MockOptions().tokens
    assert completion.finish_reason == "stop"
    assert sink.times == [0.0] * MockOptions().tokens  # no delays by default


async def test_max_tokens_truncates_with_length(autojump_clock: MockClock) -> None:
    completion, sink = await run(spec(MockOptions(tokens=10), max_tokens=4))
    assert len(sink.deltas) == 4
    assert completion.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4
    # The truncated text is a prefix of the full answer.
    _, full = await run(spec(MockOptions(tokens=10)))
    assert full.text.startswith(sink.text)


@pytest.mark.parametrize("max_tokens", [10, 11, 100])
async def test_max_tokens_not_reached_is_stop(autojump_clock: MockClock, max_tokens: int) -> None:
    completion, sink = await run(spec(MockOptions(tokens=10), max_tokens=max_tokens))
    assert len(sink.deltas) == 10
    assert completion.finish_reason == "stop"


async def test_ttft_and_token_delay_on_the_virtual_clock(autojump_clock: MockClock) -> None:
    start = trio.current_time()
    completion, sink = await run(spec(MockOptions(tokens=5, ttft=2.0, token_delay=0.25)))
    elapsed = [when - start for when in sink.times]
    assert elapsed == pytest.approx([2.0, 2.25, 2.5, 2.75, 3.0])
    assert trio.current_time() - start == pytest.approx(3.0)
    assert completion.finish_reason == "stop"


async def test_prompt_tokens_are_reported_before_the_first_token(autojump_clock: MockClock) -> None:
    reported_at: list[float] = []

    class Sink(RecordingSink):
        def report_prompt_tokens(self, count: int) -> None:
            super().report_prompt_tokens(count)
            reported_at.append(trio.current_time())

    start = trio.current_time()
    sink = Sink()
    await adapter().execute(
        spec(MockOptions(tokens=2, ttft=5.0), prompt="one two three four"), sink
    )
    assert sink.prompt_tokens == [4]
    assert reported_at == [pytest.approx(start)]
    assert sink.times[0] - start == pytest.approx(5.0)


async def test_chat_prompt_tokens_count_every_message(autojump_clock: MockClock) -> None:
    messages = (ChatMessage("system", "be brief"), ChatMessage("user", "say three words"))
    completion, sink = await run(
        spec(MockOptions(tokens=1), kind="chat", prompt="", messages=messages)
    )
    assert sink.prompt_tokens == [5]
    assert completion.usage == Usage(5, 1)


@pytest.mark.parametrize("fail_after", [0, 1, 3])
async def test_injected_failure_after_exactly_n_tokens(
    autojump_clock: MockClock, fail_after: int
) -> None:
    sink = RecordingSink()
    options = MockOptions(tokens=8, fail_after_tokens=fail_after, fail_message="kaboom")
    with pytest.raises(BackendError) as info:
        await adapter().execute(spec(options), sink)
    assert len(sink.deltas) == fail_after
    assert info.value.code == "backend_error"
    assert info.value.message == "kaboom"
    # The tokens that did arrive are the start of the normal answer.
    _, normal = await run(spec(MockOptions(tokens=8)))
    assert normal.text.startswith(sink.text)


async def test_injected_failure_at_the_last_token(autojump_clock: MockClock) -> None:
    sink = RecordingSink()
    with pytest.raises(BackendError):
        await adapter().execute(spec(MockOptions(tokens=4, fail_after_tokens=4)), sink)
    assert len(sink.deltas) == 4


async def test_injected_failure_beyond_the_answer_never_fires(autojump_clock: MockClock) -> None:
    completion, sink = await run(spec(MockOptions(tokens=4, fail_after_tokens=5)))
    assert len(sink.deltas) == 4
    assert completion.finish_reason == "stop"


async def test_injected_failure_keeps_the_timing(autojump_clock: MockClock) -> None:
    start = trio.current_time()
    sink = RecordingSink()
    options = MockOptions(tokens=8, ttft=1.0, token_delay=0.5, fail_after_tokens=2)
    with pytest.raises(BackendError):
        await adapter().execute(spec(options), sink)
    assert [when - start for when in sink.times] == pytest.approx([1.0, 1.5])


async def test_same_prompt_same_text(autojump_clock: MockClock) -> None:
    options = MockOptions(tokens=12)
    _, first = await run(spec(options, prompt="what is structured concurrency?"))
    _, second = await run(spec(options, prompt="what is structured concurrency?"))
    assert first.text == second.text
    assert [d[1:] for d in first.deltas] == [d[1:] for d in second.deltas]
    # The same text for a chat request whose messages join to the same prompt.
    _, chat = await run(
        spec(
            options,
            kind="chat",
            prompt="",
            messages=(ChatMessage("user", "what is structured concurrency?"),),
        )
    )
    assert chat.text == first.text


async def test_different_prompts_can_differ(autojump_clock: MockClock) -> None:
    options = MockOptions(tokens=12)
    texts = set()
    for prompt in ("a", "b", "c", "d", "e"):
        _, sink = await run(spec(options, prompt=prompt))
        texts.add(sink.text)
    assert len(texts) > 1


async def test_stop_sequence_ends_early(autojump_clock: MockClock) -> None:
    options = MockOptions(tokens=12)
    _, full = await run(spec(options))
    words = full.text.split(" ")
    # Stop on a word (from the fifth on) that does not appear anywhere in the text before it.
    index = next(i for i, word in enumerate(words) if i >= 4 and word not in " ".join(words[:i]))
    stop = words[index]

    completion, sink = await run(spec(options, stop=("never-appears", stop)))
    assert completion.finish_reason == "stop"
    assert len(sink.deltas) == index
    assert sink.text == " ".join(words[:index])
    assert stop not in sink.text
    assert completion.usage is not None
    assert completion.usage.completion_tokens == index


async def test_stop_sequence_beats_max_tokens(autojump_clock: MockClock) -> None:
    options = MockOptions(tokens=12)
    _, full = await run(spec(options))
    words = full.text.split(" ")
    index = next(i for i, word in enumerate(words) if i >= 1 and word not in " ".join(words[:i]))
    assert index < 6
    stop = words[index]
    completion, sink = await run(spec(options, stop=(stop,), max_tokens=6))
    assert completion.finish_reason == "stop"
    assert len(sink.deltas) == index
    assert stop not in sink.text


async def test_stop_sequence_that_never_appears(autojump_clock: MockClock) -> None:
    completion, sink = await run(spec(MockOptions(tokens=6), stop=("zzz", "")))
    assert completion.finish_reason == "stop"
    assert len(sink.deltas) == 6


async def test_cancellation_stops_the_stream(autojump_clock: MockClock) -> None:
    sink = RecordingSink()
    with trio.move_on_after(2.1):
        await adapter().execute(spec(MockOptions(tokens=100, token_delay=1.0)), sink)
    assert len(sink.deltas) == 3  # at t=0, 1 and 2
