"""``PrefillNode``: what the cluster needs of a prefill node. Two implement it: ``LLMEngine`` (a node
in this process) and ``procs.RemotePrefill`` (a node in an OS process of its own, writing into
decode's pool through shared memory). The cluster never asks which it has."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request import Request, SamplingParams


class PrefillNode(Protocol):
    cfg: "EngineConfig"
    on_prefill_done: "Callable[[Request], None] | None"    # the cluster's handoff, called when prefill ends
    sending: dict                                          # transfer key -> the request whose pages are sent
    transfer_seq: Iterator[int]                            # this node's transfer sequence numbers

    def new_request(self, prompt, sampling: "SamplingParams | None" = None, tenant: str = "default", rid: str = "",
                    incarnation: int | None = None, user: str = "", cache_salt: str = "") -> "Request":
        """A request on this node (scope and tag chain derived here); nothing taken yet."""

    def check_fits_pool(self, num_tokens: int) -> None:
        """InputError when ``num_tokens`` cannot fit this node's pool (before anything is taken)."""

    def enqueue(self, req: "Request") -> None: ...

    def abort(self, req: "Request", reason: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list: ...
