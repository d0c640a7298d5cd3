"""Retry only what is transient, with jittered exponential backoff and an overall deadline.

`retrying` and `call_with_retry` serve a call that succeeds or fails whole. Its attempts and
deadline count from the first try. `ProgressRetry` serves a streamed read that resumes where
it was cut. Its budget starts again each time the failed attempts have moved a chunk.
So a healthy but slow download outlives any fixed deadline, and a stream cut now and then
is never killed for it. Only a stream that stops moving, or trickles a few bytes per attempt,
runs out of retries.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

import tenacity

from dlstore.config import RetryConfig
from dlstore.errors import TransientError

__all__ = ["ProgressRetry", "call_with_retry", "retrying"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def _log_retry(state: tenacity.RetryCallState) -> None:
    # Only the error's own text: our errors are built without credentials in them.
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "transient storage error (attempt %d, next in %.2fs): %s",
        state.attempt_number,
        state.next_action.sleep if state.next_action else 0.0,
        exc,
    )


def retrying(policy: RetryConfig) -> tenacity.Retrying:
    """A tenacity controller: `for attempt in retrying(p): with attempt: ...`.

    Only `TransientError` is retried. When attempts or the deadline run out, the last one is raised.
    """
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.max_attempts) | tenacity.stop_after_delay(policy.deadline_s),
        wait=tenacity.wait_random_exponential(multiplier=policy.initial_backoff_s, max=policy.max_backoff_s),
        retry=tenacity.retry_if_exception_type(TransientError),
        before_sleep=_log_retry,
        reraise=True,
    )


def call_with_retry(policy: RetryConfig, fn: Callable[[], T]) -> T:
    """Call `fn()` under `policy`; see `retrying`."""
    return retrying(policy)(fn)


class ProgressRetry:
    """The retry budget of one resumable stream, renewed by progress.

    It allows `max_attempts` failures in a row, within `deadline_s` of the last progress.
    Progress is `least` bytes moved by the attempts since then, so a trickle is no progress.

    >>> retry = ProgressRetry(RetryConfig(deadline_s=30), least=2**20)
    >>> while True:                                            # doctest: +SKIP
    ...     try:
    ...         read_some_more()                                # resumes from the next byte
    ...         break
    ...     except TransientError as exc:
    ...         retry.failed(exc, moved=bytes_it_moved)         # raises exc once the budget is spent
    """

    def __init__(self, policy: RetryConfig, *, least: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.least = least
        self._clock = clock
        self._failures = 0
        self._moved = 0
        self._since = clock()

    def failed(self, exc: TransientError, moved: int) -> None:
        """Count a failed attempt that moved `moved` bytes: sleep the backoff, or raise `exc` when spent.

        Once attempts since the last progress have moved `least` bytes, a fresh budget starts."""
        self._moved += moved
        if self._moved >= self.least:
            self._failures, self._moved, self._since = 0, 0, self._clock()
        else:
            self._failures += 1
            if self._failures >= self.policy.max_attempts or self._clock() - self._since >= self.policy.deadline_s:
                raise exc
        # Full jitter over an exponential cap, as tenacity's wait_random_exponential in `retrying`.
        cap = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2 ** max(self._failures - 1, 0))
        pause = random.uniform(0, cap)
        log.warning("transient storage error (attempt %d, next in %.2fs): %s", self._failures + 1, pause, exc)
        time.sleep(pause)
