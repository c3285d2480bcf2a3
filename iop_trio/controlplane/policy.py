"""Policy: where a model may run (node labels) and what an API key may do (models, rates).

Rate limits are token buckets refilled continuously on trio's clock (MockClock-testable). The
requests bucket is charged one per request up front. The tokens bucket cannot know a request's
cost in advance: a request is admitted while the bucket is not empty, and charged its real usage
when it ends, so a burst may overdraw it and the next requests wait for the refill.
"""

from __future__ import annotations

import math

import trio
from attrs import define, field

from ..config import ApiKeyConfig, ModelPolicy


def labels_match(required: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in required.items())


class Placement:
    def __init__(self, models: dict[str, ModelPolicy]) -> None:
        self._models = models

    def allows(self, model: str, labels: dict[str, str]) -> bool:
        policy = self._models.get(model)
        return policy is None or labels_match(policy.node_labels, labels)


@define
class TokenBucket:
    """``per_minute`` units per minute, holding at most one minute's worth."""

    per_minute: float
    level: float = field(init=False)
    updated: float = field(init=False, factory=trio.current_time)

    def __attrs_post_init__(self) -> None:
        self.level = self.per_minute

    def _refill(self) -> None:
        now = trio.current_time()
        self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def try_take(self, amount: float) -> bool:
        self._refill()
        if self.level < amount:
            return False
        self.level -= amount
        return True

    def has_credit(self) -> bool:
        self._refill()
        return self.level > 0

    def charge(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def seconds_until(self, amount: float) -> float:
        """How long until ``amount`` is available (for ``Retry-After``)."""
        self._refill()
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * 60.0 / self.per_minute


class RateLimited(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = max(1, math.ceil(retry_after))


class KeyLimits:
    """The rate-limit state of one API key."""

    def __init__(self, config: ApiKeyConfig) -> None:
        self.config = config
        self.requests = TokenBucket(config.requests_per_minute) if config.requests_per_minute else None
        self.tokens = TokenBucket(config.tokens_per_minute) if config.tokens_per_minute else None

    def allows_model(self, model: str) -> bool:
        return not self.config.models or model in self.config.models

    def admit(self) -> None:
        """Charge one request; raise RateLimited when either bucket is empty."""
        if self.tokens is not None and not self.tokens.has_credit():
            raise RateLimited(
                f"Rate limit reached for tokens per minute ({self.config.tokens_per_minute}).",
                self.tokens.seconds_until(1),
            )
        if self.requests is not None and not self.requests.try_take(1):
            raise RateLimited(
                f"Rate limit reached for requests per minute ({self.config.requests_per_minute}).",
                self.requests.seconds_until(1),
            )

    def charge_tokens(self, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.charge(tokens)
