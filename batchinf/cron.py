"""Five-field cron expressions (minute hour day-of-month month day-of-week) in a time zone.

Supported: `*`, numbers, ranges `a-b`, steps `*/n` and `a-b/n`, lists `a,b`, month and weekday
names (`jan`, `mon`), weekday 7 as Sunday, and the macros @yearly @monthly @weekly @daily @hourly.
As in Vixie cron, when both day fields are restricted a day matches if either matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from batchinf.errors import BatchinfError


class CronError(BatchinfError):
    """A cron expression or time zone that cannot be parsed."""


MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
          "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}
MONTHS = {m: i for i, m in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], start=1)}
WEEKDAYS = {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
FIELDS = (("minute", 0, 59, {}), ("hour", 0, 23, {}), ("day of month", 1, 31, {}),
          ("month", 1, 12, MONTHS), ("day of week", 0, 7, WEEKDAYS))


def _value(token: str, name: str, lo: int, hi: int, names: dict[str, int]) -> int:
    v = names.get(token.lower()) if names else None
    if v is None:
        if not token.isdigit():
            raise CronError(f"cron {name} field: {token!r} is not a number"
                            + (f" or a name ({', '.join(names)})" if names else ""))
        v = int(token)
    if not lo <= v <= hi:
        raise CronError(f"cron {name} field: {v} is outside {lo}-{hi}")
    return v


def _field(text: str, name: str, lo: int, hi: int, names: dict[str, int]) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        rng, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise CronError(f"cron {name} field: step {step_text!r} must be a positive number")
            step = int(step_text)
        if rng == "*":
            a, b = lo, hi
        elif "-" in rng:
            a_text, b_text = rng.split("-", 1)
            a, b = _value(a_text, name, lo, hi, names), _value(b_text, name, lo, hi, names)
            if a > b:
                raise CronError(f"cron {name} field: range {rng!r} runs backwards")
        else:
            a = _value(rng, name, lo, hi, names)
            b = hi if step_text else a
        out.update(range(a, b + 1, step))
    return frozenset(out)


@dataclass(frozen=True)
class Cron:
    expr: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]      # 0 = Sunday
    dom_any: bool
    dow_any: bool

    def matches_day(self, d: date) -> bool:
        if d.month not in self.months:
            return False
        dom, dow = d.day in self.days, (d.weekday() + 1) % 7 in self.weekdays
        if self.dom_any or self.dow_any:
            return dom and dow
        return dom or dow

    def first_fire(self, d: date, tz: ZoneInfo) -> datetime | None:
        """The first time the expression fires on local date `d`, or None if it does not that day.
        (A local time skipped by a DST change maps to the instant just after the change.)"""
        if not self.matches_day(d):
            return None
        return datetime(d.year, d.month, d.day, min(self.hours), min(self.minutes), tzinfo=tz)


def parse_cron(expr: str) -> Cron:
    text = MACROS.get(expr.strip().lower(), expr.strip())
    parts = text.split()
    if len(parts) != 5:
        raise CronError(f"cron expression {expr!r} needs 5 fields (minute hour day-of-month month "
                        "day-of-week), e.g. '0 2 * * *' for 02:00 every day")
    sets = [_field(p, name, lo, hi, names) for p, (name, lo, hi, names) in zip(parts, FIELDS)]
    weekdays = frozenset(d % 7 for d in sets[4])
    return Cron(expr, sets[0], sets[1], sets[2], sets[3], weekdays,
                dom_any=parts[2].startswith("*"), dow_any=parts[4].startswith("*"))


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CronError(f"unknown time zone {name!r}; use an IANA name such as UTC or Europe/Berlin") from None
