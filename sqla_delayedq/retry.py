"""Retry policies: when a failed message is tried again, and when it is dead.

A policy is any object with ``max_attempts`` and ``delay(attempts) -> timedelta``;
:class:`ExponentialBackoff` is the default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, runtime_checkable

from .errors import InvalidArgument

__all__ = ["ExponentialBackoff", "RetryPolicy"]


@runtime_checkable
class RetryPolicy(Protocol):
    """Decides the delay before the next attempt and how many attempts a message gets."""

    @property
    def max_attempts(self) -> int:
        """Attempts after which a failing message is dead (>= 1)."""

    def delay(self, attempts: int) -> timedelta:
        """Wait before the next attempt, given the attempts made so far (>= 1)."""


@dataclass(frozen=True)
class ExponentialBackoff:
    """``initial * multiplier ** (attempts - 1)``, capped at ``maximum``, with ± ``jitter``.

    ``jitter`` is a fraction: 0.2 spreads each delay uniformly over ±20 %, so consumers that
    failed together do not retry together.
    """

    max_attempts: int = 5
    initial: timedelta = timedelta(seconds=1)
    multiplier: float = 2.0
    maximum: timedelta = timedelta(hours=1)
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial < timedelta(0) or self.maximum < timedelta(0):
            raise InvalidArgument("initial and maximum delays must not be negative")
        if self.multiplier < 1:
            raise InvalidArgument(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise InvalidArgument(f"jitter must be in [0, 1), got {self.jitter}")

    def delay(self, attempts: int) -> timedelta:
        base = self.initial.total_seconds() * self.multiplier ** max(attempts - 1, 0)
        base = min(base, self.maximum.total_seconds())
        if self.jitter:
            base *= 1 + self.rng.uniform(-self.jitter, self.jitter)
        return timedelta(seconds=base)
