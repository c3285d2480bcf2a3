"""Placement by node labels, token buckets on trio's clock, and per-key limits."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from iop_trio.config import ApiKeyConfig, EdgeConfig, ModelPolicy, NodeOverride, structure
from iop_trio.controlplane import KeyLimits, Placement, RateLimited, TokenBucket
from iop_trio.controlplane.policy import labels_match

# --- placement -----------------------------------------------------------------------------


def test_labels_match_is_a_subset_match() -> None:
    labels = {"gpu": "a100", "zone": "eu", "tier": "prod"}
    assert labels_match({}, labels)
    assert labels_match({}, {})
    assert labels_match({"gpu": "a100"}, labels)
    assert labels_match({"gpu": "a100", "zone": "eu"}, labels)
    assert labels_match(labels, labels)
    assert not labels_match({"gpu": "t4"}, labels)  # same key, other value
    assert not labels_match({"rack": "r1"}, labels)  # key missing
    assert not labels_match({"gpu": "a100", "zone": "us"}, labels)  # all must match
    assert not labels_match({"gpu": "a100"}, {})


def test_placement_allows_models_without_policy_anywhere() -> None:
    placement = Placement({"big": ModelPolicy(node_labels={"gpu": "a100"})})
    assert placement.allows("small", {})
    assert placement.allows("small", {"gpu": "t4"})
    assert Placement({}).allows("anything", {"x": "y"})


def test_placement_requires_all_of_the_models_labels() -> None:
    placement = Placement({
        "big": ModelPolicy(node_labels={"gpu": "a100", "zone": "eu"}),
        "free": ModelPolicy(),  # a policy with no labels allows every node
    })
    assert placement.allows("big", {"gpu": "a100", "zone": "eu", "extra": "ok"})
    assert not placement.allows("big", {"gpu": "a100"})
    assert not placement.allows("big", {"gpu": "a100", "zone": "us"})
    assert not placement.allows("big", {})
    assert placement.allows("free", {})
    assert placement.allows("free", {"gpu": "t4"})


# --- TokenBucket ---------------------------------------------------------------------------


async def test_token_bucket_starts_full_and_refills_continuously(autojump_clock: MockClock) -> None:
    bucket = TokenBucket(60)  # one per second
    assert bucket.level == 60
    assert bucket.try_take(60)
    assert not bucket.try_take(1)
    assert bucket.level == pytest.approx(0)  # a refused take charges nothing

    await trio.sleep(1)
    assert bucket.try_take(1)
    assert not bucket.try_take(1)

    await trio.sleep(2.5)
    assert bucket.try_take(2)
    assert not bucket.try_take(1)  # 0.5 left
    assert bucket.try_take(0.5)


async def test_token_bucket_holds_at_most_one_minute(autojump_clock: MockClock) -> None:
    bucket = TokenBucket(30)
    assert bucket.try_take(10)
    await trio.sleep(3600)
    assert bucket.seconds_until(30) == 0
    assert not bucket.try_take(31)
    assert bucket.try_take(30)
    assert bucket.level == pytest.approx(0)


async def test_token_bucket_seconds_until(autojump_clock: MockClock) -> None:
    bucket = TokenBucket(120)  # two per second
    assert bucket.seconds_until(120) == 0  # full
    assert bucket.seconds_until(0) == 0
    assert bucket.try_take(120)
    assert bucket.seconds_until(1) == pytest.approx(0.5)
    assert bucket.seconds_until(60) == pytest.approx(30)
    await trio.sleep(10)  # 20 back
    assert bucket.seconds_until(60) == pytest.approx(20)
    assert bucket.seconds_until(20) == pytest.approx(0)
    assert bucket.seconds_until(10) == 0


async def test_token_bucket_charge_can_overdraw(autojump_clock: MockClock) -> None:
    bucket = TokenBucket(60)
    assert bucket.has_credit()
    bucket.charge(90)
    assert bucket.level == pytest.approx(-30)
    assert not bucket.has_credit()
    assert bucket.seconds_until(1) == pytest.approx(31)
    await trio.sleep(30.5)
    assert bucket.has_credit()  # 0.5 > 0: credit, even if less than one unit
    assert not bucket.try_take(1)


# --- RateLimited ---------------------------------------------------------------------------


def test_rate_limited_rounds_retry_after_up_to_whole_seconds() -> None:
    assert RateLimited("x", 29.01).retry_after == 30
    assert RateLimited("x", 30).retry_after == 30
    assert RateLimited("x", 0.2).retry_after == 1
    assert RateLimited("x", 0).retry_after == 1  # never "retry after 0 seconds"
    error = RateLimited("slow down", 5)
    assert error.message == "slow down"
    assert str(error) == "slow down"


# --- KeyLimits -----------------------------------------------------------------------------


async def test_allows_model() -> None:
    assert KeyLimits(ApiKeyConfig(key="k")).allows_model("anything")  # empty: all models
    limits = KeyLimits(ApiKeyConfig(key="k", models=("a", "b")))
    assert limits.allows_model("a")
    assert limits.allows_model("b")
    assert not limits.allows_model("c")
    assert not limits.allows_model("")


async def test_no_limits_admit_everything(autojump_clock: MockClock) -> None:
    limits = KeyLimits(ApiKeyConfig(key="k"))
    assert limits.requests is None and limits.tokens is None
    for _ in range(1000):
        limits.admit()
    limits.charge_tokens(10**9)  # no token limit: nothing to charge
    limits.admit()


async def test_admit_charges_one_request_per_call(autojump_clock: MockClock) -> None:
    limits = KeyLimits(ApiKeyConfig(key="k", requests_per_minute=3))
    assert limits.requests is not None
    limits.admit()
    assert limits.requests.level == pytest.approx(2)
    limits.admit()
    limits.admit()
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert "requests per minute (3)" in info.value.message
    assert info.value.retry_after == 20  # one request comes back every 20 s
    assert limits.requests.level == pytest.approx(0)  # the refusal charged nothing

    await trio.sleep(12)
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert info.value.retry_after == 8
    await trio.sleep(8)
    limits.admit()
    with pytest.raises(RateLimited):
        limits.admit()


async def test_retry_after_is_rounded_up(autojump_clock: MockClock) -> None:
    limits = KeyLimits(ApiKeyConfig(key="k", requests_per_minute=7))
    for _ in range(7):
        limits.admit()
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert info.value.retry_after == 9  # 60 / 7 = 8.57 s
    await trio.sleep(8.5)
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert info.value.retry_after == 1  # 0.07 s: still at least one second


async def test_requests_refill_to_a_full_minute_only(autojump_clock: MockClock) -> None:
    limits = KeyLimits(ApiKeyConfig(key="k", requests_per_minute=2))
    limits.admit()
    limits.admit()
    await trio.sleep(600)
    limits.admit()
    limits.admit()
    with pytest.raises(RateLimited):
        limits.admit()


async def test_token_bucket_admits_while_it_has_credit(autojump_clock: MockClock) -> None:
    limits = KeyLimits(ApiKeyConfig(key="k", tokens_per_minute=100))
    assert limits.tokens is not None and limits.requests is None
    limits.admit()  # admitting charges no tokens: the cost is unknown until the run ends
    limits.admit()
    assert limits.tokens.level == pytest.approx(100)
    limits.charge_tokens(99)
    limits.admit()  # one token of credit left: still admitted
    limits.charge_tokens(1)
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert "tokens per minute (100)" in info.value.message
    assert info.value.retry_after == 1  # 0.6 s for one token


async def test_charge_tokens_overdraws_and_the_bucket_refills(autojump_clock: MockClock) -> None:
    limits = KeyLimits(ApiKeyConfig(key="k", tokens_per_minute=100))
    limits.admit()
    limits.charge_tokens(250)  # a burst: one request used 2.5 minutes' worth
    assert limits.tokens is not None
    assert limits.tokens.level == pytest.approx(-150)
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert info.value.retry_after == 91  # (150 + 1) tokens at 100/min = 90.6 s

    await trio.sleep(89)
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert info.value.retry_after == 2  # 151 - 148.3 = 2.7 tokens = 1.6 s
    await trio.sleep(2)
    limits.admit()


async def test_a_token_refusal_does_not_use_up_a_request(autojump_clock: MockClock) -> None:
    limits = KeyLimits(ApiKeyConfig(key="k", requests_per_minute=1, tokens_per_minute=60))
    assert limits.requests is not None
    limits.charge_tokens(120)
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert "tokens" in info.value.message
    assert limits.requests.level == pytest.approx(1)
    await trio.sleep(61)  # tokens back above zero
    limits.admit()
    assert limits.requests.level == pytest.approx(0)
    with pytest.raises(RateLimited) as info:
        limits.admit()
    assert "requests per minute (1)" in info.value.message


async def test_keys_have_independent_buckets(autojump_clock: MockClock) -> None:
    a = KeyLimits(ApiKeyConfig(key="a", requests_per_minute=1))
    b = KeyLimits(ApiKeyConfig(key="b", requests_per_minute=1))
    a.admit()
    with pytest.raises(RateLimited):
        a.admit()
    b.admit()


# --- the config that feeds policy ----------------------------------------------------------


def test_api_keys_and_model_policies_from_yaml_data() -> None:
    config = structure(
        {
            "api_keys": [
                "sk-plain",
                {"key": "sk-batch", "name": "batch", "models": ["m"], "requests_per_minute": 10,
                 "tokens_per_minute": 1000, "priority": -5},
            ],
            "models": {"big": {"node_labels": {"gpu": "a100"}}},
            "queue": {"max_waiting": 3, "timeout": 2.5},
            "nodes": {"overrides": [{"node_id": "n1", "max_concurrency": 2},
                                    {"labels": {"gpu": "t4"}, "max_concurrency": 4}]},
        },
        EdgeConfig,
        "edge.yaml",
    )
    plain, batch = config.api_keys
    assert plain == ApiKeyConfig(key="sk-plain")  # a plain string: a key with no limits
    assert batch == ApiKeyConfig(
        key="sk-batch", name="batch", models=("m",), requests_per_minute=10,
        tokens_per_minute=1000, priority=-5,
    )
    assert config.models == {"big": ModelPolicy(node_labels={"gpu": "a100"})}
    assert (config.queue.max_waiting, config.queue.timeout) == (3, 2.5)
    assert config.nodes.overrides == (
        NodeOverride(max_concurrency=2, node_id="n1"),
        NodeOverride(max_concurrency=4, labels={"gpu": "t4"}),
    )
