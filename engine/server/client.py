"""``EngineClient``: all the app knows of the engine (as vLLM's ``EngineClient``). Two implement
it: ``EngineLoop`` (the engine on a thread of this process: tests, an embedding app) and
``RemoteLoop`` (the engine in a process of its own: ``kvledger serve``)."""
from __future__ import annotations

from typing import Protocol

from engine.request import SamplingParams
from engine.server.loop import Stream


class EngineClient(Protocol):
    pending: int                      # submitted and not finished (the 429 check, /metrics)
    error: BaseException | None       # set when the engine failed (the server exits 1)

    @property
    def alive(self) -> bool:
        """The engine can still take work (/health)."""

    def start(self) -> None:
        """Start stepping (a no-op where the engine runs from construction)."""

    async def submit(self, prompt_ids: list[int], sp: SamplingParams, tenant: str, user: str = "",
                     cache_salt: str = "") -> Stream:
        """Admit a request; raises InputError (nothing taken) or QueueFull. A request the engine
        refuses after admission comes back as a finished stream with its error."""

    def abort(self, stream: Stream, reason: str = "client disconnected") -> None: ...

    async def metrics_text(self) -> bytes:
        """Prometheus text of the engine-side metrics kept outside the app's registry (b"" if none)."""

    def begin_drain(self, drain_s: float) -> None:
        """Stop admitting now and start the ``drain_s`` clock, without waiting (the first signal:
        requests cut at the deadline are answered while the HTTP server still waits for them)."""

    def stop(self, drain_s: float) -> None:
        """Stop admitting, let running requests finish for up to ``drain_s``, abort the rest."""
