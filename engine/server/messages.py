"""The messages between ``kvledger serve``'s HTTP process and its engine process: typed msgspec
structs, MessagePack on the wire (as vLLM's engine core client speaks to its core), one tag each.

    HTTP -> engine   Submit  Abort  MetricsQuery  Stop
    engine -> HTTP   Ready  StartFailed  Admitted  Step  MetricsText  Bye

A ``RequestView`` is what the HTTP side shows of a request: its incarnation and, once it has
finished, its usage, finish reason and error (an ``ErrorView``: the exception's class name and text).
"""
from __future__ import annotations

import msgspec


class Sampling(msgspec.Struct, frozen=True, array_like=True):
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    ignore_eos: bool


class ErrorView(msgspec.Struct, frozen=True, array_like=True):
    kind: str                      # the exception's class name (the app tells a few apart)
    text: str


class RequestView(msgspec.Struct, frozen=True, array_like=True):
    incarnation: int
    finished: bool = False
    error: ErrorView | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    prompt_tokens_billed: int = 0
    cached_tokens: int = 0


# ---- HTTP -> engine --------------------------------------------------------------------------------
class Submit(msgspec.Struct, tag="submit", array_like=True):
    rid: int
    prompt_ids: list[int]
    sampling: Sampling
    tenant: str
    user: str
    cache_salt: str


class Abort(msgspec.Struct, tag="abort", array_like=True):
    rid: int
    reason: str


class MetricsQuery(msgspec.Struct, tag="metrics", array_like=True):
    qid: int


class Stop(msgspec.Struct, tag="stop", array_like=True):
    drain_s: float


Command = Submit | Abort | MetricsQuery | Stop


# ---- engine -> HTTP --------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: dict
    context_length: int
    pseudonyms: dict[str, str]     # tenant -> pseudonym, for the HTTP side's metric labels


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    message: str


class Admitted(msgspec.Struct, tag="admitted", array_like=True):
    rid: int
    view: RequestView | None       # None: refused (``error`` says why)
    error: ErrorView | None = None


class Delivery(msgspec.Struct, array_like=True):
    rid: int
    tokens: list[int]
    final: RequestView | None      # set once the request has finished


class Step(msgspec.Struct, tag="step", array_like=True):
    deliveries: list[Delivery]     # every live request's new tokens of one engine step


class MetricsText(msgspec.Struct, tag="metrics_text", array_like=True):
    qid: int
    text: bytes


class Bye(msgspec.Struct, tag="bye", array_like=True):
    pass


Reply = Ready | StartFailed | Admitted | Step | MetricsText | Bye

encode = msgspec.msgpack.Encoder().encode
decode_command = msgspec.msgpack.Decoder(Command).decode
decode_reply = msgspec.msgpack.Decoder(Reply).decode
