"""Process plumbing the engine's children share: dying with the parent, running a server child."""
from __future__ import annotations

import os
import signal
import subprocess


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies (kill -9 included), so
    no prefill node outlives its router and no engine or dashboard child outlives its server. Run in
    the child (first thing, or as a ``preexec_fn``)."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
        if os.getppid() == 1:                  # the parent died before prctl: follow it now
            os._exit(1)
    except (OSError, AttributeError):          # not Linux: the parent's own shutdown still stops it
        pass


def run_child(argv: list[str], env: dict) -> int:
    """Run a server child (Streamlit) as this command: SIGTERM and SIGINT sent to this process are
    forwarded to it, and on Linux it is killed if this process dies (kill -9 included)."""
    child = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent)
    forward = lambda signum, frame: child.send_signal(signum)      # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:       # the child got the SIGINT too; wait for it to stop
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
