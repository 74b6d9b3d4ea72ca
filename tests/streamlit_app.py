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


def charts(at: AppTest) -> list[tuple[dict, dict[str, "pl.DataFrame"]]]:
    """The page's Vega-Lite charts as Streamlit sent them: each chart's spec and its data by the name
    its layers read it under (the chart's own data: ``""``)."""
    import json

    import polars as pl
    import pyarrow as pa

    def frame(raw: bytes) -> pl.DataFrame:
        return pl.from_arrow(pa.ipc.open_stream(raw).read_all())

    out = []
    for el in at.get("vega_lite_chart"):
        p = el.proto
        data = {d.name: frame(d.data.data) for d in p.datasets}
        if p.data.data:
            data[""] = frame(p.data.data)
        out.append((json.loads(p.spec), data))
    return out


def unknown_fields(spec: dict, data: dict) -> list[str]:
    """The fields a chart's marks encode (axes, colours, shapes, tooltips...) that the data its layer
    reads has no column of - what Vega-Lite would draw as nothing, with no error."""
    missing = []

    def walk(node: dict, name: str) -> None:
        name = node.get("data", {}).get("name", name) if isinstance(node.get("data"), dict) else name
        for channel in node.get("encoding", {}).values():
            for ch in channel if isinstance(channel, list) else [channel]:
                if "field" in ch and ch["field"] not in data[name].columns:
                    missing.append(f"{name or 'data'}.{ch['field']}")
        for layer in node.get("layer", []):
            walk(layer, name)
    walk(spec, "")
    return missing
