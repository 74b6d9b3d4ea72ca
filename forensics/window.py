"""Times a reader names: ISO 8601 (a time without a zone is UTC), or relative to now as Grafana and
journalctl write them - ``now``, ``now-15m``, ``-2h``, ``30s``, ``7d`` (that long ago). Every time
in the store is naive UTC; so is every time this returns."""
from __future__ import annotations

import datetime as dt
import re

UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_RELATIVE = re.compile(r"^(?:now)?\s*-?\s*(\d+(?:\.\d+)?)\s*([smhdw])$|^now$")
MAX_AGO = dt.timedelta(days=36_500)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def parse_when(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``text`` as naive UTC; ValueError naming the accepted forms."""
    text = text.strip()
    m = _RELATIVE.match(text.lower())
    if m:
        now = now or utcnow()
        if m.group(1) is None:
            return now
        ago = dt.timedelta(**{UNITS[m.group(2)]: float(m.group(1))})
        if ago > MAX_AGO:
            raise ValueError(f"{text!r} reaches back more than 100 years")
        return now - ago
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not a time: {text!r} (ISO 8601 such as 2026-09-01T12:00:00Z, or relative such as "
                         "now-15m, 2h, 7d)") from None
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def ago(t: dt.datetime, now: dt.datetime | None = None) -> str:
    """How long before ``now`` ``t`` was, in words a pager reads at a glance (``3 min ago``)."""
    s = max(0.0, ((now or utcnow()) - t).total_seconds())
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"
