"""Retry only what is transient, with jittered exponential backoff and an overall deadline."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import tenacity

from dlstore.config import RetryConfig
from dlstore.errors import TransientError

__all__ = ["call_with_retry", "retrying"]

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

    Only `TransientError` is retried; `NotFound`, `AuthError` and everything else go
    straight to the caller. When attempts or the deadline run out, the last
    `TransientError` is raised as is.
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
