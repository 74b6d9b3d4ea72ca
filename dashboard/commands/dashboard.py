"""``kvledger dashboard``: the live Streamlit exposure dashboard, started by module name
(``python -m dashboard.serve``) with the store and engine choice in its environment."""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.commands.options import add_store, check_port
from engine.errors import InputError
from forensics.commands.options import EngineChoice, add_engine_options, add_verify_options, engine_choice


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    store: str
    host: str = "127.0.0.1"
    port: int = 8501
    refresh: float = 2.0
    engine: EngineChoice = EngineChoice()
    run: str | None = None
    allow_unverified: bool = False
    anchor: str | None = None
    warm: bool = True


def add_arguments(d) -> None:
    add_store(d, "the store to show")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    d.add_argument("--port", type=int, default=8501, help="port (default 8501, Streamlit's)")
    d.add_argument("--refresh", type=float, default=2.0, help="seconds between live refreshes (default 2)")
    d.add_argument("--run", metavar="BOOT", default=None,
                   help="show one run only: its boot id or a unique prefix (`kvledger forensics runs`; default all)")
    add_verify_options(d, "show the panels of a store that does not verify, under the red UNVERIFIED banner "
                          "(default: the banner and verify's words only, as every reader refuses)")
    add_engine_options(d)
    d.add_argument("--no-warm", dest="warm", action="store_false",
                   help="do not build the store's shared tables (requests, exposure slots, n-gram evidence) while the "
                        "server starts; the first page load then builds them (default: built at start, on a thread)")


def make_config(a) -> DashboardConfig:
    check_port("--port", a.port)
    import math
    if not (math.isfinite(a.refresh) and 0.5 <= a.refresh <= 3600):
        raise InputError(f"--refresh must be in [0.5, 3600] seconds, got {a.refresh}")
    return DashboardConfig(a.store, a.host, a.port, a.refresh, engine_choice(a), a.run, a.allow_unverified, a.anchor,
                           a.warm)


def run(c: DashboardConfig) -> int:
    from engine.osutil import run_child
    if not (Path(c.store) / "chain").is_dir():
        print(f"kvledger: note: no store at {c.store} yet; the dashboard shows it once the engine writes there",
              file=sys.stderr)
    app = importlib.util.find_spec("dashboard.app").origin      # the script Streamlit runs (not imported here)
    env = {**os.environ, "KVLEDGER_STORE": str(Path(c.store).resolve()), "KVLEDGER_REFRESH_S": str(c.refresh),
           "KVLEDGER_ENGINE": c.engine.engine, "KVLEDGER_DSN": c.engine.dsn or "",
           "KVLEDGER_CHDB_PATH": c.engine.chdb_path or os.environ.get("KVLEDGER_CHDB_PATH", ""),
           "KVLEDGER_RUN": c.run or "", "KVLEDGER_ANCHOR": c.anchor or "",
           "KVLEDGER_ALLOW_UNVERIFIED": "1" if c.allow_unverified else "", "KVLEDGER_DASHBOARD_WARM": "1" if c.warm else "0"}
    print(f"kvledger dashboard on http://{c.host}:{c.port} (store {c.store})", file=sys.stderr)
    return run_child([sys.executable, "-m", "dashboard.serve", app, "--server.address", c.host,
                      "--server.port", str(c.port), "--server.headless", "true",
                      "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"], env=env)
