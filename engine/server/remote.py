"""The engine in a process of its own, reached over ZMQ (as vLLM's V1 engine core is).

``kvledger serve`` runs the HTTP server in one process and the engine - model, pools, the
recorder and the store's writer, the engine-side metrics - in another, so HTTP, JSON and SSE work
never holds the GIL the engine's step needs. The two talk over two ZMQ ``ipc://`` PUSH/PULL
sockets in the typed messages of ``engine/server/messages.py`` (msgspec, MessagePack). One
``Step`` message per engine step carries every live request's new tokens (one wake-up of the
HTTP side per step). ``RemoteLoop`` is an ``EngineClient`` as ``EngineLoop`` is (``client.py``),
so the app does not know which it has. The engine process dies with its parent
(PR_SET_PDEATHSIG): a ``kill -9`` of the server leaves no engine holding the store.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from engine.errors import InputError, KvledgerError, ModelLoadError, OutOfPages, ReadCheckViolation
from engine.osutil import die_with_parent
from engine.recorder import RecorderFactory
from engine.request import SamplingParams
from engine.server import messages as M
from engine.server.config import ServeConfig
from engine.server.loop import EngineLoop, QueueFull, Stream

log = logging.getLogger("kvledger.server")
_ERRORS = {c.__name__: c for c in (InputError, OutOfPages, ReadCheckViolation, QueueFull, KvledgerError)}
_OTHER: dict[str, type] = {}


def _error_out(e: BaseException | None) -> M.ErrorView | None:
    return None if e is None else M.ErrorView(type(e).__name__, str(e))


def _error_in(v: M.ErrorView | None) -> BaseException | None:
    """The engine's exception as the HTTP side sees it: same class name and message (the classes the
    app tells apart are rebuilt as themselves; others as a KvledgerError subclass of that name)."""
    if v is None:
        return None
    cls = _ERRORS.get(v.kind) or _OTHER.setdefault(v.kind, type(v.kind, (KvledgerError,), {}))
    e = cls.__new__(cls)
    BaseException.__init__(e, v.text)
    return e


def _view(req, finished: bool) -> M.RequestView:
    if not finished:
        return M.RequestView(req.incarnation)
    return M.RequestView(req.incarnation, True, _error_out(req.error), req.first_token_at, req.finish_reason,
                         req.prompt_tokens_billed, req.cached_tokens)


def _sampling(sp: SamplingParams) -> M.Sampling:
    return M.Sampling(sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.ignore_eos)


def outcome(req) -> str:
    """A finished request's ``outcome`` label: ok, aborted (its client went away, or the drain cut
    it), or the error's type."""
    from engine.request import Status
    if req.status is Status.FINISHED_ABORTED:
        return "aborted"
    return "ok" if req.error is None else type(req.error).__name__


@dataclass(eq=False)
class RemoteRequest:
    """The HTTP side's view of a request running in the engine process (the fields the app reads)."""
    incarnation: int
    output_ids: list = field(default_factory=list)
    is_finished: bool = False
    error: BaseException | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    prompt_tokens_billed: int = 0
    cached_tokens: int = 0

    def finish(self, view: M.RequestView) -> None:
        self.is_finished = True
        self.error = _error_in(view.error)
        self.first_token_at, self.finish_reason = view.first_token_at, view.finish_reason
        self.prompt_tokens_billed, self.cached_tokens = view.prompt_tokens_billed, view.cached_tokens


# ---- the engine process ------------------------------------------------------------------------------
class _ChildLoop(EngineLoop):
    """EngineLoop whose commands come from, and whose tokens go to, the HTTP process's sockets."""

    def __init__(self, backend, out: zmq.Socket, metrics, **kw):
        super().__init__(backend, **kw)
        self.out, self.metrics = out, metrics
        self._rid: dict[int, int] = {}          # incarnation -> the HTTP side's request id

    def _send(self, msg) -> None:
        self.out.send(M.encode(msg))

    def _command(self, cmd) -> None:
        if isinstance(cmd, M.Submit):
            s = cmd.sampling
            sp = SamplingParams(s.max_tokens, s.temperature, s.top_p, s.seed, s.ignore_eos)
            try:
                req = self._admit(cmd.prompt_ids, sp, cmd.tenant, cmd.user, cmd.cache_salt)
            except BaseException as e:       # noqa: BLE001 - refused: the handler answers 4xx/429
                self._send(M.Admitted(cmd.rid, None, _error_out(e)))
                return
            stream = Stream(req, None)
            self._live[req.incarnation] = stream
            self._rid[req.incarnation] = cmd.rid
            self.pending += 1
            self._send(M.Admitted(cmd.rid, _view(req, req.is_finished)))
        elif isinstance(cmd, M.Abort):
            inc = next((i for i, r in self._rid.items() if r == cmd.rid), None)
            if inc is not None and inc in self._live:
                self._abort(self._live[inc], cmd.reason)
        elif isinstance(cmd, M.MetricsQuery):
            from prometheus_client import generate_latest
            self._send(M.MetricsText(cmd.qid, generate_latest(self.metrics.registry)))
        elif isinstance(cmd, M.Stop):
            self.drain_s = cmd.drain_s
            self._stop.set()

    def _deliver(self) -> None:
        out = []
        for inc, s in list(self._live.items()):
            req = s.req
            n = len(req.output_ids)
            if n > s.sent or req.is_finished:
                out.append(M.Delivery(self._rid[inc], req.output_ids[s.sent:n],
                                      _view(req, True) if req.is_finished else None))
                s.sent = n
            if req.is_finished:
                del self._live[inc]
                del self._rid[inc]
                self.pending -= 1
                if self.on_finish is not None:
                    self.on_finish(req)
        if out:
            self._send(M.Step(out))
        if self.steps % 256 == 0:
            self.backend.forget_finished()


def engine_main(c: ServeConfig, open_recorder: RecorderFactory, cmd_addr: str, out_addr: str, parent: int) -> None:
    """The engine process: build everything the engine owns, say ready, step until told to stop,
    then drain, close the store (sealed) and say bye."""
    die_with_parent()
    for s in (signal.SIGINT, signal.SIGTERM):     # the parent decides when to stop (and drains first)
        signal.signal(s, signal.SIG_IGN)
    ctx = zmq.Context()
    cmds, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    cmds.connect(cmd_addr)
    out.connect(out_addr)
    try:
        import torch
        torch.set_num_threads(c.torch_threads)
        from engine.server.backend import build_engine
        built = build_engine(c, open_recorder)
    except BaseException as e:  # noqa: BLE001 - the parent reports it as the server's error
        out.send(M.encode(M.StartFailed(f"{type(e).__name__}: {e}" if not isinstance(e, KvledgerError) else str(e))))
        out.close(linger=2000)
        cmds.close(linger=0)
        ctx.term()
        return
    tel, metrics = built.recorder, built.metrics
    loop = _ChildLoop(built.backend, out, metrics, max_pending=c.max_pending,
                      on_finish=lambda r: metrics.finished(r, outcome(r)))
    metrics.queue.set_function(lambda: loop.pending)
    loop.watch = lambda: os.getppid() != parent                  # the parent is gone: drain and stop

    def reader() -> None:
        while True:
            try:
                msg = M.decode_command(cmds.recv())
            except zmq.ZMQError:
                return
            loop._cmds.put(msg)
    threading.Thread(target=reader, name="kvledger-engine-commands", daemon=True).start()
    from engine.server.backend import ApiKeys
    pseudonyms = {t: tel.pseudonym(t) for t in ApiKeys.load(c.keys).tenants()}   # for the HTTP side's labels
    out.send(M.encode(M.Ready(built.info, built.context_length, pseudonyms)))
    try:
        loop.run()
    finally:
        tel.close()
        built.backend.close()
        out.send(M.encode(M.Bye()))
        out.close(linger=5000)       # (the command socket is the reader thread's: it goes with the process)


# ---- the HTTP process ----------------------------------------------------------------------------
class RemoteLoop:
    """The engine process, as the app sees an EngineLoop."""

    def __init__(self, c: ServeConfig, open_recorder: RecorderFactory, startup_timeout: float = 600.0):
        import multiprocessing
        self.max_pending = c.max_pending
        self._dir = tempfile.mkdtemp(prefix="kvledger-engine-")
        cmd_addr, out_addr = f"ipc://{self._dir}/cmd", f"ipc://{self._dir}/out"
        self.ctx = zmq.Context()
        self.cmds, self.out = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.cmds.bind(cmd_addr)
        self.out.bind(out_addr)
        self._send_lock = threading.Lock()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(c, open_recorder, cmd_addr, out_addr, os.getpid()), name="kvledger-engine", daemon=False)
        self.proc.start()
        self._rid = 0
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._streams: dict[int, Stream] = {}
        self.pending = 0                  # submitted, not finished (+1 on the event loop, -1 on the reader thread)
        self._pending_lock = threading.Lock()
        self.error: BaseException | None = None
        self.on_dead = lambda: None
        self._stopping = False
        self._drain_sent: float | None = None      # the drain the engine was told (begin_drain or stop)
        self._bye = threading.Event()
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.out.poll(200):
                msg = M.decode_reply(self.out.recv())
                if isinstance(msg, M.Ready):
                    self.info, self.context_length, self.pseudonyms = msg.info, msg.context_length, msg.pseudonyms
                    break
                self._close_sockets()
                self.proc.join(10)
                text = msg.message if isinstance(msg, M.StartFailed) else f"unexpected {type(msg).__name__}"
                raise ModelLoadError(text) if "model" in text.lower() else InputError(text)
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self._close_sockets()
                raise KvledgerError(f"the engine process exited while starting (exit code {self.proc.exitcode})")
        self._reader = threading.Thread(target=self._read, name="kvledger-engine-replies", daemon=True)
        self._reader.start()

    # ---- EngineLoop's interface ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc.is_alive() and not self._bye.is_set()

    def start(self) -> None:
        """The engine process runs from construction; nothing to start."""

    def run(self) -> None:
        raise RuntimeError("the engine runs in its own process")

    def _send(self, msg) -> None:
        with self._send_lock:
            if not self.cmds.closed:
                self.cmds.send(M.encode(msg))

    async def submit(self, prompt_ids: list[int], sp, tenant: str, user: str = "", cache_salt: str = "") -> Stream:
        if self._stopping or not self.alive:
            raise QueueFull("the server is shutting down")
        if self.pending >= self.max_pending:
            raise QueueFull(f"{self.pending} requests in flight, the limit is {self.max_pending}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._rid += 1
        rid = self._rid
        self._waiting[rid] = (loop, fut)
        self._count(+1)
        self._send(M.Submit(rid, list(prompt_ids), _sampling(sp), tenant, user, cache_salt))
        try:
            return await fut
        except asyncio.CancelledError:      # the client left while it was being admitted
            self._send(M.Abort(rid, "client disconnected before admission"))
            raise

    def abort(self, stream: Stream, reason: str = "client disconnected") -> None:
        self._send(M.Abort(stream.rid, reason))

    def _count(self, d: int) -> None:
        with self._pending_lock:
            self.pending += d

    async def metrics_text(self) -> bytes:
        if not self.alive:
            return b""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._rid += 1
        self._waiting[self._rid] = (loop, fut)
        self._send(M.MetricsQuery(self._rid))
        return await asyncio.wait_for(fut, timeout=10)

    def begin_drain(self, drain_s: float) -> None:
        """Tell the engine to stop admitting and start its drain clock now; returns at once."""
        if self._drain_sent is not None or not self.proc.is_alive():
            return
        self._drain_sent = drain_s
        self._send(M.Stop(drain_s))

    def stop(self, drain_s: float) -> None:
        """Stop admitting; the engine drains for up to ``drain_s``, closes the store, and exits.
        Idempotent (uvicorn's shutdown and a failed start may both call it)."""
        with self._send_lock:
            if self._stopping:
                return
            self._stopping = True
        if self.proc.is_alive():
            if self._drain_sent is None or drain_s < self._drain_sent:     # none yet, or a shorter one now
                self._drain_sent = drain_s
                self._send(M.Stop(drain_s))
            self.proc.join(drain_s + 30)
        if self.proc.is_alive():
            log.warning("the engine process did not exit %.0f s after the drain deadline; killing it", 30)
            self.proc.kill()
            self.proc.join(10)
        self._bye.set()
        self._reader.join(5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.cmds.close(linger=0)
        self.out.close(linger=0)
        self.ctx.term()
        for f in ("cmd", "out"):
            Path(self._dir, f).unlink(missing_ok=True)
        os.rmdir(self._dir)

    # ---- replies ------------------------------------------------------------------------------------
    def _read(self) -> None:
        while not self._bye.is_set():
            try:
                if not self.out.poll(200):
                    if not self.proc.is_alive():
                        self._engine_gone(f"the engine process exited (code {self.proc.exitcode})")
                        return
                    continue
                msg = M.decode_reply(self.out.recv())
            except zmq.ZMQError:
                return
            if isinstance(msg, M.Step):
                self._step(msg.deliveries)
            elif isinstance(msg, M.Admitted):
                self._admitted(msg.rid, msg.view, msg.error)
            elif isinstance(msg, M.MetricsText):
                loop, fut = self._waiting.pop(msg.qid)
                loop.call_soon_threadsafe(_resolve, fut, msg.text, None)
            elif isinstance(msg, M.Bye):
                self._bye.set()

    def _admitted(self, rid: int, view: M.RequestView | None, error: M.ErrorView | None) -> None:
        loop, fut = self._waiting.pop(rid)
        if view is None:
            self._count(-1)
            loop.call_soon_threadsafe(_resolve, fut, None, _error_in(error))
            return
        stream = Stream(RemoteRequest(view.incarnation), loop)
        stream.rid = rid
        if view.finished:                     # finished as it was admitted (the cluster refused it)
            stream.req.finish(view)
        self._streams[rid] = stream
        loop.call_soon_threadsafe(_admit_stream, fut, stream, self)

    def _step(self, items: list[M.Delivery]) -> None:
        batches: dict = {}
        for rid, tokens, final in ((d.rid, d.tokens, d.final) for d in items):
            s = self._streams.get(rid)
            if s is None:
                continue
            if final is not None:
                del self._streams[rid]
                self._count(-1)
            batches.setdefault(s.loop, []).append((s, tokens, final))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, batch)
            except RuntimeError:            # the HTTP side's event loop is closed (a forced exit): nobody waits
                pass

    def _engine_gone(self, why: str) -> None:
        """The engine process died: every request still running ends with an error (500), new ones get 503."""
        self.error = KvledgerError(why)
        for rid, (loop, fut) in list(self._waiting.items()):
            loop.call_soon_threadsafe(_resolve, fut, None, QueueFull(why))
        self._waiting.clear()
        view = M.RequestView(0, True, M.ErrorView("EngineFailure", why))
        for s in list(self._streams.values()):
            s.loop.call_soon_threadsafe(_deliver_all, [(s, [], view)])
        self._streams.clear()
        with self._pending_lock:
            self.pending = 0
        self.on_dead()


def _resolve(fut: asyncio.Future, value, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _admit_stream(fut: asyncio.Future, stream: Stream, remote: RemoteLoop) -> None:
    if fut.done():                            # cancelled: the client left while it was being admitted
        remote.abort(stream, "client disconnected before admission")
        return
    fut.set_result(stream)


def _deliver_all(batch: list) -> None:
    """On the event loop: one step's tokens for every stream, from one wake-up (the request's view
    updated before its queue hears of them, as the in-process loop's Request is)."""
    for stream, tokens, final in batch:
        req = stream.req
        req.output_ids += tokens
        if final is not None:
            req.finish(final)
        if final is not None or not stream.final_only:
            stream.events.put_nowait((tokens, final is not None))
        if final is not None and stream.on_done is not None:
            stream.on_done(req)
