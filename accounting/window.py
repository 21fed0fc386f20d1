"""The report window and the date words a sysadmin types (pure functions)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta


class AccountingError(ValueError):
    """Input a sysadmin can fix (a bad date, an unknown grouping); the message says how."""


DATE_HELP = "YYYY-MM-DD, YYYY-MM-DDTHH:MM[:SS] (UTC unless it has an offset), now, today, or -7d / -12h / -30m"
_RELATIVE = re.compile(r"^-(\d+)([dhm])$")
_UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def parse_when(value: str, *, now: datetime, option: str = "date") -> datetime:
    """A date word → UTC-aware datetime; raise AccountingError naming ``option`` and the forms."""
    v = value.strip()
    if v == "now":
        return now
    if v == "today":
        return datetime.combine(now.date(), datetime.min.time(), UTC)
    m = _RELATIVE.match(v)
    if m:
        return now - timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
    try:
        t = datetime.fromisoformat(v)
    except ValueError as e:
        raise AccountingError(f"{option} {value!r} is not a date: use {DATE_HELP}") from e
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


@dataclass(frozen=True)
class Window:
    """The half-open interval [start, end) a report covers, UTC-aware."""

    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise AccountingError("window bounds must carry a time zone")
        if self.end <= self.start:
            raise AccountingError(f"--end ({self.end.isoformat()}) must be after "
                                  f"--start ({self.start.isoformat()})")

    @property
    def seconds(self) -> float:
        """The window's length in seconds."""
        return (self.end - self.start).total_seconds()

    def days(self) -> list[date]:
        """Every UTC day the window touches, in order."""
        first, last = self.start.date(), (self.end - timedelta(microseconds=1)).date()
        return [first + timedelta(days=i) for i in range((last - first).days + 1)]

    def clamp(self, t: datetime) -> datetime:
        """``t`` moved into the window (for attributing an event to a day)."""
        return min(max(t, self.start), self.end - timedelta(microseconds=1))


def make_window(start: str, end: str, *, now: datetime | None = None) -> Window:
    """The window from two date words; raise AccountingError on a bad or empty one."""
    now = now or datetime.now(UTC).replace(microsecond=0)
    return Window(parse_when(start, now=now, option="--start"), parse_when(end, now=now, option="--end"))
