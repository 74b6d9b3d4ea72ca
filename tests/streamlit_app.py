"""The dashboard under Streamlit's AppTest as a page load on a running server (tests and benches).

Streamlit's server discovers the installed packages' custom components once, when its Runtime
starts (streamlit/runtime/runtime.py); AppTest does it again for every instance it makes - the
metadata of every installed distribution parsed, 0.25-0.5 s on this machine, about a third of a
kept page's render in bench/dashboard.py. Here the instances of one process share one discovery,
as the page loads of one `kvledger dashboard` do."""
from __future__ import annotations

import re
import time

from streamlit.components.v2.component_manager import BidiComponentManager
from streamlit.testing.v1 import AppTest

_COMPONENTS: list[BidiComponentManager] = []


def app_test(path: str, timeout: float) -> AppTest:
    """``AppTest.from_file(path)`` sharing this process's component discovery."""
    at = AppTest.from_file(path, default_timeout=timeout)
    if not _COMPONENTS:
        manager = BidiComponentManager()
        manager.discover_and_register_components(start_file_watching=False)
        _COMPONENTS.append(manager)
    at._bidi_component_manager = _COMPONENTS[0]     # (AppTest.run discovers only where this is None)
    return at


def timed_run(path: str, timeout: float) -> tuple[AppTest, float, float]:
    """One page load of the app (benches): the AppTest after its run, the run's wall seconds and the
    script's own time (the page footer's "rendered in"); the run raised nothing."""
    at = app_test(path, timeout)
    t = time.perf_counter()
    at.run()
    took = time.perf_counter() - t
    assert not at.exception, [e.message for e in at.exception]
    footer = next((c.value for c in at.caption if "rendered in" in c.value), None)
    assert footer, [e.value for e in at.error]
    return at, took, float(re.search(r"rendered in ([0-9.]+) s", footer).group(1))
