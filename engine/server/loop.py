"""The engine on a thread of its own, reached from asyncio through one command queue.

HTTP handlers never touch engine state: ``submit`` and ``abort`` put a command on the queue; the
engine thread runs them between steps, steps whatever is running (continuous batching across HTTP
requests: every request admitted joins the next step), and after each step hands each live request
its new tokens on that request's own asyncio queue (``loop.call_soon_threadsafe``, one wake-up per
step). ``kvledger serve`` runs it on the *main* thread of an engine process of its own
(``engine.server.remote``: commands and tokens over ZMQ), so HTTP work never holds this thread's
GIL; torch's small matrix products (a decode step's) cost about 2.7x more from a thread that is
not the main one on this machine (OpenMP). In-process use (tests, an embedding app) runs it on a
thread beside the event loop (``start``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from engine.errors import InputError, KvledgerError
from engine.request import Request, SamplingParams

log = logging.getLogger("kvledger.server")


class QueueFull(KvledgerError):
    pass


@dataclass(eq=False)
class Stream:
    """One live request as the HTTP side sees it."""
    req: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0
    done: bool = False
    on_done: "Callable | None" = None      # called with the request once it has finished (on the event loop)
    final_only: bool = False               # wake the handler only when the request finishes (non-streamed:
                                           # its tokens are in req.output_ids; no wake-up per step)

    def push(self, tokens: list[int], finished: bool) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (tokens, finished))


def _put_all(batch: list) -> None:
    """On the event loop: one step's events for every stream, from one wake-up."""
    for stream, event in batch:
        if event[1] or not stream.final_only:
            stream.events.put_nowait(event)
        if event[1] and stream.on_done is not None:
            stream.on_done(stream.req)


class Backend(Protocol):
    """What a server steps: one node (``LLMEngine``) or a cluster (``DisaggCluster``), alike."""
    nodes: list                     # every node (each an LLMEngine-like node: cfg, pool, preflight)

    def admit(self, prompt_ids: list[int], sp: SamplingParams, tenant: str, user: str = "",
              cache_salt: str = "") -> Request:
        """Take a request: InputError (nothing taken) or the request, finished already if refused."""

    def abort(self, req: Request, reason: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self): ...

    def forget_finished(self) -> None:
        """Drop what is kept about finished requests (bounded memory on a long-running server)."""

    def close(self) -> None: ...


SHUTTING_DOWN = "server shutting down: cut at the drain deadline (--drain-timeout)"


class EngineLoop:
    """Runs ``backend`` (an ``LLMEngine`` or a ``DisaggCluster``) on a thread of its own."""

    def __init__(self, backend: Backend, max_pending: int = 256, on_finish: Callable[[Request], None] | None = None):
        self.backend = backend
        self.nodes = backend.nodes
        self.max_pending, self.on_finish = max_pending, on_finish
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Stream] = {}
        self.pending = 0                      # admitted, not finished (read by /metrics and the 429 check)
        self.steps = 0
        self._stop = threading.Event()
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.watch: Callable[[], bool] = lambda: False    # True: stop (e.g. the HTTP server is gone)

    def start(self) -> None:
        """Run the engine on a new thread (tests, or an embedding app)."""
        threading.Thread(target=self.run, name="kvledger-engine", daemon=True).start()

    def run(self) -> None:
        """Step until ``stop`` (or ``watch``) says so, then drain; blocks the calling thread."""
        try:
            self._run()
        finally:
            self._done.set()

    @property
    def alive(self) -> bool:
        return not self._done.is_set()

    # ---- asyncio side ----------------------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], sp: SamplingParams, tenant: str, user: str = "",
                     cache_salt: str = "") -> Stream:
        """Admit a request; raises InputError (bad input, over context or pool: nothing taken) or
        QueueFull. A request the cluster rejects comes back as a finished stream with its error."""
        if self._stop.is_set():
            raise QueueFull("the server is shutting down")
        if self.pending >= self.max_pending:
            raise QueueFull(f"{self.pending} requests in flight, the limit is {self.max_pending}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(("submit", (prompt_ids, sp, tenant, user, cache_salt), loop, fut))
        return await fut

    def abort(self, stream: Stream, reason: str = "client disconnected") -> None:
        self._cmds.put(("abort", stream, reason))

    async def metrics_text(self) -> bytes:
        """The engine's metrics are the app's own registry in one process: nothing more to add."""
        return b""

    def begin_drain(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self._stop.set()

    def stop(self, drain_s: float) -> None:
        """Stop admitting, let running requests finish for up to ``drain_s``, abort the rest."""
        self._stop.set()
        self._done.wait(timeout=drain_s + 5)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        drain_deadline = None
        while True:
            try:                              # idle: wait a little for work; busy: only what is there
                cmd = self._cmds.get(timeout=0.02) if not self._has_work() else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._command(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if not self._stop.is_set() and self.watch():
                self._stop.set()
            if self._stop.is_set():
                # a later, shorter drain (a second signal) brings the deadline in; a longer one never pushes it out
                drain_deadline = min(drain_deadline or math.inf, time.monotonic() + self.drain_s)
                if not self._has_work():
                    return
                if time.monotonic() > drain_deadline:
                    for s in list(self._live.values()):
                        self._abort(s, SHUTTING_DOWN)
                if time.monotonic() > drain_deadline + 5:     # aborted, and still not done: never hang the exit
                    log.warning("shutdown: work still in the engine %.0f s after the drain deadline (%d live "
                                "stream(s)); stopping without it", 5, len(self._live))
                    return
            if self._has_work():
                try:
                    self.backend.step()
                    self.steps += 1
                except Exception as e:       # noqa: BLE001 - an engine bug: fail what is live, keep serving
                    log.exception("engine step failed")
                    self.error = e
                    for s in list(self._live.values()):
                        if not s.req.is_finished:
                            self._abort(s, f"engine failure: {type(e).__name__}: {e}")
            self._deliver()

    drain_s = 30.0

    def _has_work(self) -> bool:
        return self.backend.has_work()

    def _command(self, cmd) -> None:
        if cmd[0] == "submit":
            _, args, loop, fut = cmd
            try:
                stream = Stream(self._admit(*args), loop)
            except BaseException as e:       # noqa: BLE001 - handed to the handler that awaits it
                loop.call_soon_threadsafe(_set, fut, None, e, None)
                return
            self._live[stream.req.incarnation] = stream
            self.pending += 1
            loop.call_soon_threadsafe(_set, fut, stream, None, self.abort)
        elif cmd[0] == "abort":
            _, stream, reason = cmd
            self._abort(stream, reason)

    def _admit(self, prompt_ids, sp, tenant, user, salt) -> Request:
        if self._stop.is_set():
            raise QueueFull("the server is shutting down")
        return self.backend.admit(prompt_ids, sp, tenant, user=user, cache_salt=salt)

    def _abort(self, stream: Stream, reason: str) -> None:
        req = stream.req
        if req.is_finished:
            return
        self.backend.abort(req, reason)
        if not req.is_finished:              # e.g. not admitted by the engine yet
            req.error = InputError(reason)
            req.fail(req.error)

    def _deliver(self) -> None:
        """Hand each live request its new tokens: one wake-up of each event loop per step, not one
        per request (the HTTP side runs on another thread, behind the GIL)."""
        batches: dict = {}
        for inc, s in list(self._live.items()):
            req = s.req
            n = len(req.output_ids)
            if n > s.sent or req.is_finished:
                tokens = req.output_ids[s.sent:n]
                s.sent = n
                batches.setdefault(s.loop, []).append((s, (tokens, req.is_finished)))
            if req.is_finished:
                del self._live[inc]
                self.pending -= 1
                if self.on_finish is not None:
                    self.on_finish(req)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)
        if self.steps % 256 == 0:
            self.backend.forget_finished()


def _set(fut: asyncio.Future, value, error, abort) -> None:
    if fut.cancelled():                       # the client left while it was being admitted
        if value is not None:
            abort(value, "client disconnected before admission")
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
