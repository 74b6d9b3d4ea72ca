"""The dashboard under Streamlit's AppTest as a page load on a running server (tests and benches).

Streamlit's server discovers the installed packages' custom components once, when its Runtime
starts (streamlit/runtime/runtime.py); AppTest does it again for every instance it makes - the
metadata of every installed distribution parsed, 0.25-0.5 s on this machine, about a third of a
kept page's render in bench/dashboard.py. Here the instances of one process share one discovery,
as the page loads of one `kvledger dashboard` do."""
from __future__ import annotations

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
