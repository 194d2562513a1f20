"""Value checks shared by every surface that accepts tenant-supplied numbers and strings
(job manifests, OpenAI batch lines). Each returns what is wrong, naming `where`, or None."""

from __future__ import annotations

from typing import Any


def number_problem(v: Any, where: str, lo: float, hi: float, *, lo_open: bool = False) -> str | None:
    """A real number in [lo, hi] (or (lo, hi] with lo_open); booleans are not numbers."""
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool)
          and (v > lo if lo_open else v >= lo) and v <= hi)
    return None if ok else f"{where} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r:.60}"


def integer_problem(v: Any, where: str, lo: int | None = None, hi: int | None = None) -> str | None:
    """An integer in [lo, hi]; a bound left out (None) is open. Booleans are not integers."""
    ok = (isinstance(v, int) and not isinstance(v, bool)
          and (lo is None or v >= lo) and (hi is None or v <= hi))
    return None if ok else f"{where} must be {_integers(lo, hi)}, got {v!r:.60}"


def _integers(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if hi is not None:
        return f"an integer <= {hi}"
    return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")


def stop_strings(v: Any, where: str) -> tuple[tuple[str, ...], str | None]:
    """Stop strings: one non-empty string or a list of them -> (tuple, None), or ((), problem)."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        return (), f"{where} must be a non-empty string or a list of them, got {v!r:.60}"
    return tuple(items), None


def clip(text: str | None, limit: int, length: int | None = None) -> str | None:
    """`text` cut to at most `limit` characters, the cut noted with the full length, so a stored or
    shown value (an error row's record id or message) stays bounded whatever a record holds.
    `length`: the full length when `text` is already a prefix of the value."""
    full = len(text) if text is not None and length is None else (length or 0)
    if text is None or full <= limit:
        return text
    note = f"… ({full} characters)"
    return text[:max(0, limit - len(note))] + note
