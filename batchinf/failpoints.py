"""Failpoints, fault injection for tests and chaos runs: BATCHINF_FAILPOINTS="point=action;point=action".

Actions: `crash` (exit at once, as SIGKILL would leave the process), `raise`, `sleep(SECONDS)`,
each optionally prefixed by a probability, e.g. `0.2*crash`. Record-targeted points are written
`execute.record[ID]=crash`. When the variable is unset, `hit()` is one dict lookup.
"""

from __future__ import annotations

import os
import random
import re
import time

from batchinf.config import Settings, load_settings
from batchinf.errors import ConfigError


class FailpointError(RuntimeError):
    """Raised by a failpoint whose action is `raise`."""


_ACTION = re.compile(r"^(?:(?P<p>[0-9.]+)\*)?(?P<act>crash|raise|sleep\((?P<secs>[0-9.]+)\))$")


def parse(spec: str) -> dict[str, tuple[float, str, float]]:
    points: dict[str, tuple[float, str, float]] = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, action = item.partition("=")
        m = _ACTION.match(action.strip())
        if not m:
            raise ConfigError(f"BATCHINF_FAILPOINTS: cannot parse {item!r}; "
                              "write point=crash|raise|sleep(SECONDS), optionally P*action")
        act = "sleep" if m.group("secs") else m.group("act")
        points[name.strip()] = (float(m.group("p") or 1.0), act, float(m.group("secs") or 0))
    return points


_points: dict[str, tuple[float, str, float]] = {}
_rng = random.Random()


def _load(s: Settings) -> None:
    """Take the failpoints of `s`. BATCHINF_FAILPOINTS_SEED seeds the probabilistic draws; each
    process mixes in its pid, so a restarted worker does not replay its predecessor's draws."""
    global _points
    _points = parse(s.failpoints)
    _rng.seed(None if s.failpoints_seed is None else f"{s.failpoints_seed}:{os.getpid()}")


def reload() -> None:
    """Read BATCHINF_FAILPOINTS and BATCHINF_FAILPOINTS_SEED from the environment again."""
    _load(load_settings())


_load(load_settings())   # a process's failpoints are those of its environment when it imports this


def hit(point: str) -> None:
    if not _points:
        return
    spec = _points.get(point)
    if spec is None:
        return
    prob, act, secs = spec
    if prob < 1.0 and _rng.random() >= prob:
        return
    if act == "crash":
        os._exit(137)
    if act == "raise":
        raise FailpointError(f"failpoint {point} raised")
    time.sleep(secs)


def active() -> bool:
    return bool(_points)
