"""The object a record names (an image, an audio file): its bytes inline, or the content of the
object its URI names, pinned (HEAD, then a read of exactly that version), within the job's
grants for a confined job, and bounded in size. What is wrong is a `RecordObjectProblem` whose
code names the kind of object: invalid_<what>, <what>_unreachable, <what>_forbidden,
<what>_too_large."""

from __future__ import annotations

from typing import Any

from batchinf.errors import BatchinfError, ManifestError


class RecordObjectProblem(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def record_object(value: Any, obj: Any, what: str, max_bytes: int) -> bytes:
    """The record's `what`: `value` as bytes, or the pinned content of the object URI `value`
    (`obj.may_read` checks it against the job's grants first)."""
    from batchinf.store import get_store, normalize_uri

    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, str) or not value.strip():
        raise RecordObjectProblem(f"invalid_{what}", f"must be {what} bytes or an object URI, got {type(value).__name__}")
    try:
        uri = normalize_uri(value)
    except BatchinfError as exc:
        raise RecordObjectProblem(f"{what}_unreachable", f"URI {value!r:.200} is not usable ({exc})") from None
    try:
        if obj.may_read is not None:
            obj.may_read(uri)
    except ManifestError as exc:
        raise RecordObjectProblem(f"{what}_forbidden", str(exc)) from None
    try:
        store = get_store(uri)
        pin = store.head(uri)
        if pin.size > max_bytes:
            raise RecordObjectProblem(f"{what}_too_large", f"object {uri} is {pin.size} bytes, over {max_bytes}")
        with store.open_read(pin) as fh:
            data = fh.read(max_bytes + 1)
    except BatchinfError as exc:
        raise RecordObjectProblem(f"{what}_unreachable", f"object {value!r} cannot be read ({exc}); check the URI, "
                                                         "that the object exists and that batchinf may read it") from None
    if len(data) > max_bytes:
        raise RecordObjectProblem(f"{what}_too_large", f"object {uri} grew past {max_bytes} bytes while read")
    return data
