"""The one retry policy: a backoff function and a classification of failures.

Every stage asks `classify(exc)` what a failure means:
- RETRY: transient (storage 5xx, connection reset, database restart, a worker without the
  requested device, anything unexpected):
  try again later with `compute_backoff`, within a bounded budget;
- FAIL_SHARD: the attempt lost its lease (`StaleAttemptError`): nothing to do, another
  attempt owns the shard;
- FAIL_JOB: no retry can fix it (bad input, bundle, manifest, missing object, failed
  verification): the job fails now with the message.
"""

from __future__ import annotations

import random
import time
from enum import StrEnum
from typing import Any, Callable, TypeVar

from batchinf.errors import (BundleError, DeviceUnavailableError, InputError, ManifestError, StaleAttemptError,
                             StoreError, TransientError, VerificationError)

T = TypeVar("T")


class Outcome(StrEnum):
    RETRY = "retry"
    FAIL_SHARD = "fail_shard"   # this attempt is over; the shard carries on without it
    FAIL_JOB = "fail_job"


PERMANENT = (BundleError, InputError, ManifestError, StoreError, VerificationError)


def classify(exc: BaseException) -> Outcome:
    if isinstance(exc, StaleAttemptError):
        return Outcome.FAIL_SHARD
    if isinstance(exc, (TransientError, DeviceUnavailableError)):   # another worker may have the device
        return Outcome.RETRY
    if isinstance(exc, PERMANENT):
        return Outcome.FAIL_JOB
    return Outcome.RETRY


def compute_backoff(attempt: int, *, base: float = 1.0, cap: float = 30.0) -> float:
    """Capped exponential backoff with full jitter: uniform in [0, min(cap, base * 2**(attempt-1))]."""
    return random.uniform(0, min(cap, base * 2 ** max(0, attempt - 1)))


def retrying(fn: Callable[..., T], *args: Any, attempts: int = 10, base: float = 0.2, cap: float = 5.0,
             **kwargs: Any) -> T:
    """Call fn, retrying TransientError (a ledger or store call) with `compute_backoff`."""
    for i in range(1, attempts + 1):
        try:
            return fn(*args, **kwargs)
        except TransientError:
            if i == attempts:
                raise
            time.sleep(compute_backoff(i, base=base, cap=cap))
    raise AssertionError("unreachable")
