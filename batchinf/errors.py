"""One rooted error hierarchy. Messages name the record, object or file and the fix."""

from __future__ import annotations


class BatchinfError(Exception):
    """Base of every error batchinf raises on purpose; the CLI prints these without a traceback.
    `param` names the request field at fault and `line` the line of an uploaded file, where one
    is (the OpenAI API's error envelope carries both)."""

    def __init__(self, *args: object, param: str | None = None, line: int | None = None) -> None:
        super().__init__(*args)
        self.param, self.line = param, line


class ConfigError(BatchinfError):
    """An environment variable holds a value batchinf cannot use; the message names it."""


class ManifestError(BatchinfError):
    """The job manifest is invalid (unknown key, wrong type, missing field)."""


class InputError(BatchinfError):
    """An input object cannot be read as pinned (missing, changed since pinned, unreadable)."""


class BundleError(BatchinfError):
    """A model bundle is missing, tampered with, drifted or unsafe (pickle)."""


class DeviceUnavailableError(BundleError):
    """This worker cannot run the bundle on the requested device (cuda without CUDA). Not the
    bundle's fault: the attempt fails and is retried, perhaps on another worker of a mixed fleet."""


class RecordsFailed(BatchinfError):
    """Some requests of one engine call ended without an answer (a remote engine's retries ran out,
    or the server refused them): request key -> why. Each becomes its record's error row; the
    answers the call gave stand."""

    def __init__(self, failures: dict[int, str]) -> None:
        super().__init__(f"{len(failures)} record(s) got no answer")
        self.failures = failures


class LedgerError(BatchinfError):
    """The ledger refused an operation (illegal transition, unknown job or shard)."""


class StaleAttemptError(LedgerError):
    """An attempt lost its fencing token: another attempt owns the shard now."""


class AttemptReleased(BatchinfError):
    """The attempt stops without committing (its job was cancelled before it finished a record):
    its lease is given back, charged to nothing."""


class JobStopped(BatchinfError):
    """Raised by a task inside its batch when its job was cancelled (`split.stop()`: diffusion at
    the next denoising step, speech at the next batch of windows): that batch is not done; the
    attempt commits the batches before it and leaves the rest."""


class StoreError(BatchinfError):
    """An object store operation failed permanently."""


class TransientError(BatchinfError):
    """A fault worth retrying with backoff (storage 5xx, connection reset, database restart)."""


class VerificationError(BatchinfError):
    """Published output does not match its manifest (coverage, digests, row counts)."""


class NotFoundError(BatchinfError):
    """No such object for this tenant (another tenant's looks exactly the same)."""
