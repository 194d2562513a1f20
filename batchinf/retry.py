"""The one retry policy: a backoff function and a classification of failures.

Every stage asks `classify(exc)` what a failure means, verification and publishing included:
- RETRY: transient (a storage, ledger or broker fault: storage 5xx or throttling, a lost, refused
  or timed-out connection, a local I/O error or full disk, a database restart; a worker without
  the requested device; anything unexpected), and any error raised *from* a transient fault (a
  part that "cannot be read" because the store was down): try again later with
  `compute_backoff`, within a bounded budget;
- FAIL_SHARD: the attempt lost its lease (`StaleAttemptError`): nothing to do, another
  attempt owns the shard;
- FAIL_JOB: no retry can fix it (bad input, bundle, manifest, missing object, a store refusing
  the request (no bucket, access denied), a real verification failure: coverage, a digest or
  row count that differs, an unlisted part): the job fails now with the message.
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
        return Outcome.RETRY if caused_by_transient(exc) else Outcome.FAIL_JOB
    return Outcome.RETRY


def caused_by_transient(exc: BaseException) -> bool:
    """Whether a TransientError is among the explicit causes (`raise ... from`) of `exc`."""
    seen: set[int] = set()
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TransientError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


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
