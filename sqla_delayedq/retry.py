"""Retry policies: when a failed message is tried again, and when it is dead.

A policy is any object with ``max_attempts`` and ``delay(attempts) -> timedelta``;
:class:`ExponentialBackoff` is the default.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from ._time import require_duration
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
        check_max_attempts(self.max_attempts, "max_attempts")
        require_duration(self.initial, "initial", allow_zero=True)
        require_duration(self.maximum, "maximum", allow_zero=True)
        for name, value in (("multiplier", self.multiplier), ("jitter", self.jitter)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"{name} must be a number, got {type(value).__name__}")
        if not 1 <= self.multiplier < math.inf:
            raise InvalidArgument(f"multiplier must be >= 1 and finite, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise InvalidArgument(f"jitter must be in [0, 1), got {self.jitter}")

    def delay(self, attempts: int) -> timedelta:
        initial, cap = self.initial.total_seconds(), self.maximum.total_seconds()
        try:
            base = min(initial * self.multiplier ** max(attempts - 1, 0), cap)
        except OverflowError:  # the growth alone is past a float (attempt 1025 doubling): capped
            base = cap if initial else 0.0
        if self.jitter:
            base *= 1 + self.rng.uniform(-self.jitter, self.jitter)
        return timedelta.max if base >= _LONGEST else timedelta(seconds=base)


#: ``timedelta.max`` in seconds: a longer delay is that one.
_LONGEST = timedelta.max.total_seconds()


def check_max_attempts(value: object, name: str) -> int:
    """A policy's ``max_attempts``: an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise InvalidArgument(f"{name} must be >= 1, got {value}")
    return value


def check_policy(policy: Any) -> RetryPolicy:
    """A queue's ``retry``: a :class:`RetryPolicy` whose ``max_attempts`` is an int >= 1
    (refused when the queue is made, not at a failure, where a worker would stop on it)."""
    if not isinstance(policy, RetryPolicy):
        raise InvalidArgument(
            f"retry must have max_attempts and delay(attempts), got {type(policy).__name__}"
        )
    check_max_attempts(policy.max_attempts, f"{type(policy).__name__}.max_attempts")
    return policy
