"""Process plumbing the engine's children share: dying with the parent, running a server child; the
process's heap (glibc's allocator, Python's cyclic garbage collector)."""
from __future__ import annotations

import gc
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


HEAP_KEEP = 1 << 30     # freed blocks up to this size stay in the process's heap (keep_freed_buffers)
_heap_kept: bool | None = None


def keep_freed_buffers() -> bool:
    """glibc: serve allocations up to HEAP_KEEP from the heap and keep what is freed there, instead of
    mapping each large one afresh and unmapping it when freed. A step's activations are new tensors
    of megabytes (a 4096-token prefill's q/k/v alone 8 MB on the tiny model): mapped afresh, every
    4 KB page of each faults in again at first touch - a tenth of a long bf16 run here (A/B in
    separate processes, README). The price: the process keeps its peak heap (up to HEAP_KEEP of
    freed blocks) instead of giving it back. Once a process; True where glibc took both settings."""
    global _heap_kept
    if _heap_kept is None:
        import ctypes
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):      # not glibc (or no mallopt): the allocator's own policy
            _heap_kept = False
        else:
            # M_MMAP_THRESHOLD (-3), M_TRIM_THRESHOLD (-1); mallopt returns 1 on success
            _heap_kept = mallopt(-3, HEAP_KEEP) == 1 and mallopt(-1, HEAP_KEEP) == 1
    return _heap_kept


GC_FREEZE_ENV = "KVLEDGER_GC_FREEZE"


def freeze_heap() -> bool:
    """Python's cyclic garbage collector stops scanning the objects that exist now: a full collection,
    then ``gc.freeze()`` - what vLLM's engine does once it is built (``freeze_gc_heap`` in
    vllm/utils/gc_utils.py, called by its EngineCore and its API server). A full collection scans every
    tracked object - ~430 K once torch, transformers, the model and the telemetry are loaded - on
    whichever thread's allocation triggers it, the engine's included. The engine allocates few container
    objects a step, but with telemetry on (span rows, histograms, ledger batches) enough survive to set
    off a full collection from time to time (twice in the first 10 s of decoding the tiny workload on
    this project's 2-core machine, once in bench/telemetry.py's three minutes), 0.3-0.6 s each: a stall
    of every running request. After the freeze one takes 3-4 ms. Objects made later are collected as
    before; what is frozen is never collected (a cycle among them stays until exit), so this is for a
    process that builds an engine and then serves with it. False (nothing done) where
    KVLEDGER_GC_FREEZE=0 (the test suite: it builds hundreds of engines in one process)."""
    if os.environ.get(GC_FREEZE_ENV, "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    return True
