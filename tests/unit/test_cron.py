"""Cron expressions: fields, names, steps, macros, the day-of-month/day-of-week rule, time zones."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest

from batchinf.cron import CronError, parse_cron, zone


def test_fields_ranges_steps_lists_and_names() -> None:
    c = parse_cron("*/15 2-4,22 1,15 jan-mar,DEC mon-fri")
    assert c.minutes == {0, 15, 30, 45}
    assert c.hours == {2, 3, 4, 22}
    assert c.days == {1, 15}
    assert c.months == {1, 2, 3, 12}
    assert c.weekdays == {1, 2, 3, 4, 5}
    assert parse_cron("0 0 * * 7").weekdays == {0}              # 7 is Sunday too
    assert parse_cron("5/20 * * * *").minutes == {5, 25, 45}     # a/n: from a to the end
    daily, explicit = parse_cron("@daily"), parse_cron("0 0 * * *")
    assert (daily.minutes, daily.hours, daily.days, daily.weekdays) == \
        (explicit.minutes, explicit.hours, explicit.days, explicit.weekdays)


@pytest.mark.parametrize("expr, needle", [
    ("0 2 * *", "needs 5 fields"), ("60 * * * *", "minute field: 60 is outside 0-59"),
    ("0 24 * * *", "hour field"), ("0 0 0 * *", "day of month field: 0"), ("0 0 * 13 *", "month field"),
    ("0 0 * * 8", "day of week field"), ("*/0 * * * *", "step '0'"), ("0 5-2 * * *", "backwards"),
    ("0 0 * foo *", "'foo' is not a number or a name"), ("x * * * *", "'x' is not a number"),
])
def test_bad_expressions_name_the_field(expr: str, needle: str) -> None:
    with pytest.raises(CronError, match=needle):
        parse_cron(expr)


def test_day_of_month_and_weekday_follow_vixie_cron() -> None:
    both = parse_cron("0 0 13 * fri")          # both restricted: either matches
    assert both.matches_day(date(2026, 11, 13))   # a Friday the 13th
    assert both.matches_day(date(2026, 11, 6))    # a Friday
    assert both.matches_day(date(2026, 10, 13))   # a Tuesday the 13th
    assert not both.matches_day(date(2026, 11, 7))
    fridays = parse_cron("0 0 * * fri")        # only one restricted: that one decides
    assert [d.day for d in (date(2026, 11, 1) + timedelta(n) for n in range(30))
            if fridays.matches_day(d)] == [6, 13, 20, 27]
    assert not parse_cron("0 0 1 2 *").matches_day(date(2026, 3, 1))


def test_first_fire_is_local_to_the_zone_across_dst() -> None:
    berlin = zone("Europe/Berlin")
    c = parse_cron("30 2 * * *")
    winter = c.first_fire(date(2026, 1, 10), berlin)
    summer = c.first_fire(date(2026, 7, 10), berlin)
    assert winter.astimezone(UTC) == datetime(2026, 1, 10, 1, 30, tzinfo=UTC)
    assert summer.astimezone(UTC) == datetime(2026, 7, 10, 0, 30, tzinfo=UTC)
    # 02:30 does not exist on 2026-03-29 in Berlin: it still fires once that day
    gap = c.first_fire(date(2026, 3, 29), berlin)
    assert gap is not None and gap.astimezone(UTC).date() == date(2026, 3, 29)
    assert parse_cron("0 9,17 * * *").first_fire(date(2026, 1, 1), berlin).hour == 9
    with pytest.raises(CronError, match="unknown time zone 'Mars/Base'"):
        zone("Mars/Base")
