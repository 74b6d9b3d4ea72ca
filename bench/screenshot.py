"""Screenshot of the dashboard for the README: serve STORE, open it in Debian's Chromium, save PNG."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def main(store: str, out: str = "docs/dashboard.png") -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dash = subprocess.Popen([sys.executable, "-m", "engine.commands", "dashboard", "--store", store, "--port", str(port),
                             "--refresh", "600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = b.new_page(viewport={"width": 1500, "height": 2400})
            for _ in range(60):
                try:
                    page.goto(f"http://127.0.0.1:{port}", timeout=5000)
                    break
                except Exception:
                    time.sleep(1)
            page.get_by_text("Preflight per node").first.wait_for(timeout=60_000)
            time.sleep(4)
            page.screenshot(path=out, full_page=True)
            b.close()
    finally:
        os.killpg(dash.pid, 15)
    print(f"wrote {Path(out).resolve()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
