"""The FastAPI app: OpenAI-compatible routes over the engine loop, and ``serve`` (uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with SSE),
``GET /v1/models``, ``POST /tokenize``, ``GET /health``, ``GET /metrics``, ``GET /server_info``.
Tenants come from API keys (``Authorization: Bearer``); errors come in the OpenAI error shape.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from engine.errors import InputError, KvledgerError, OutOfPages, ReadCheckViolation
from engine.osutil import freeze_heap
from engine.recorder import RecorderFactory
from engine.request import SamplingParams
from engine.server import protocol as P
from engine.server.config import ServeConfig
from engine.server.backend import ApiKeys, Tenant
from engine.server.limits import Limits, RateLimiter, Refusal
from engine.server.client import EngineClient
from engine.server.loop import SHUTTING_DOWN, QueueFull, Stream
from engine.server.metrics import ServerMetrics

log = logging.getLogger("kvledger.server")
PLAIN_TEMPLATE = "{role}: {content}\n"       # per message, then "assistant:" (models without a chat template)


@dataclass
class State:
    loop: EngineClient
    tokenizer: object
    model_name: str
    keys: ApiKeys
    metrics: ServerMetrics
    info: dict
    context_length: int
    chat_template: str | None = None
    drain_s: float = 30.0
    limiter: RateLimiter = field(default_factory=RateLimiter)
    on_shutdown: list = field(default_factory=list)
    metrics_key: str | None = None    # /metrics and /server_info behind this bearer key (None: open, on loopback)
    start_engine: bool = True         # False: the caller runs the engine loop (serve: on the main thread)


def render_chat(state: State, messages: list[P.ChatMessage]) -> str:
    """The model's chat template when it has one (tokenizer_config.json), else PLAIN_TEMPLATE."""
    if state.chat_template:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(state.chat_template).render(
            messages=[m.model_dump(exclude_none=True) for m in messages], add_generation_prompt=True,
            bos_token="", eos_token="")
    return "".join(PLAIN_TEMPLATE.format(role=m.role, content=m.content) for m in messages) + "assistant:"


class Decoder:
    """Detokenizes a growing list of ids into text deltas (holding back a partial UTF-8 character),
    incrementally as vLLM does: each call decodes only the ids since the last emitted text plus
    the window before them (``prefix``..``read``), not the whole output again; the final call
    reconciles with one decode of everything, so the deltas always add up to ``decode(ids)``."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.text = tokenizer, [], ""
        self.prefix = self.read = 0          # ids[prefix:read]: the window already emitted as text

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        if final:
            text = self.tok.decode(self.ids)
            delta, self.text = text[len(self.text):], text
            return delta
        before = self.tok.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        delta = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta


def _err(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
         param: str | None = None, headers: dict | None = None) -> JSONResponse:
    s, body = P.error(status, message, kind, code, param)
    return JSONResponse(body, status_code=s, headers=headers)


def _admission_error(e: BaseException) -> JSONResponse:
    text = str(e)
    if isinstance(e, (InputError, OutOfPages)):
        code = "context_length_exceeded" if ("context length" in text or "KV pool" in text or "pool of" in text) else None
        return _err(400, text, code=code)
    if isinstance(e, QueueFull):
        return _err(429, f"server busy: {text}; retry later", "rate_limit_error", headers={"Retry-After": "1"})
    return _err(500, f"{type(e).__name__}: {text}", "internal_error")


def _rate_limited(r: Refusal) -> JSONResponse:
    """429 in OpenAI's shape: type requests | tokens, code rate_limit_exceeded, Retry-After in seconds."""
    headers = dict(r.headers)
    if r.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(r.retry_after)))
        headers["retry-after-ms"] = str(max(1, math.ceil(r.retry_after * 1000)))
    return _err(429, r.message, "tokens" if r.limit == "tokens" else "requests", "rate_limit_exceeded", headers=headers)


def _failed(req) -> JSONResponse | None:
    """The error response of a request that finished with an error (None: it did not)."""
    e = req.error
    if e is None:
        return None
    if str(e) == SHUTTING_DOWN:
        return _err(503, f"{e}; retry (on another replica)", "server_error", code="server_shutting_down",
                    headers={"Retry-After": "1"})
    if isinstance(e, ReadCheckViolation):
        return _err(500, f"this request was stopped by the KV read check and returned nothing: {e}", "internal_error",
                    code="read_check_violation")
    if isinstance(e, (InputError, OutOfPages)) and req.first_token_at is None and not req.output_ids:
        return _admission_error(e)
    return _err(500, f"{type(e).__name__}: {e}", "internal_error")


async def _body(request: Request) -> dict | JSONResponse:
    """The JSON body, read up to MAX_BODY_BYTES (413 beyond), as UTF-8 JSON (400 otherwise)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > P.MAX_BODY_BYTES:
        return _err(413, f"request body is {declared} bytes; the limit is {P.MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > P.MAX_BODY_BYTES:
            return _err(413, f"request body is over the limit of {P.MAX_BODY_BYTES} bytes")
        chunks.append(part)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return _err(400, f"request body is not valid UTF-8 (byte {e.start})")
    except ValueError as e:
        return _err(400, f"request body is not JSON: {e}")
    except RecursionError:
        return _err(400, "request body is nested too deep (past Python's recursion limit)")
    if not isinstance(body, dict):
        return _err(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _validation(e: ValidationError) -> JSONResponse:
    first = e.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ()))
    msg = first.get("msg", "invalid")
    if first.get("type") == "extra_forbidden":
        msg = "unsupported parameter (this server does not implement it)"
    elif first.get("type") == "literal_error" and where in ("n", "logprobs", "echo", "best_of"):
        msg = f"unsupported value: {msg}"
    return _err(400, f"{where}: {msg}", param=where or None)


# ---- the routes' work, one function each (create_app only wires them) ----------------------------
def tenant_of(state: State, request: Request) -> Tenant | None:
    return state.keys.lookup(request.headers.get("authorization"))

def unauthorized() -> JSONResponse:
    return _err(401, "missing or unknown API key (Authorization: Bearer <key>)", "authentication_error",
                code="invalid_api_key")

async def generate(state: State, request: Request, chat: bool):
    m = state.metrics
    tenant = tenant_of(state, request)
    if tenant is None:
        return unauthorized()
    body = await _body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        cr = (P.ChatRequest if chat else P.CompletionRequest).model_validate(body)
    except ValidationError as e:
        return _validation(e)
    if cr.model not in (None, state.model_name):
        return _err(404, f"model {cr.model!r} does not exist; this server serves {state.model_name!r}",
                    code="model_not_found", param="model")
    prompt = render_chat(state, cr.messages) if chat else cr.prompt
    if isinstance(prompt, str):
        try:
            prompt_ids = state.tokenizer.encode(prompt)
        except UnicodeEncodeError:
            return _err(400, "the prompt is not valid Unicode text")
    else:
        prompt_ids = list(prompt)
    limit = cr.limit if chat else cr.max_tokens
    sp = SamplingParams(max_tokens=limit, temperature=cr.temperature, top_p=cr.top_p, seed=cr.seed)
    # the client's user / cache_salt narrow the scope the key gives (one more component of it)
    salt = json.dumps([cr.user or "", cr.cache_salt or ""]) if (cr.user or cr.cache_salt) else ""
    grant = state.limiter.admit(tenant.tenant, len(prompt_ids), limit)   # the tenant's rate limits, before the engine
    if isinstance(grant, Refusal):
        return _rate_limited(grant)
    try:
        stream = await state.loop.submit(prompt_ids, sp, tenant.tenant, tenant.user, salt)
    except (KvledgerError, QueueFull) as e:
        grant.release(None)
        m.rejections.labels(type(e).__name__, "admission").inc()
        return _admission_error(e)
    except BaseException:                        # e.g. cancelled: the client left while it was admitted
        grant.release(None)
        raise
    stream.on_done = grant.release               # its parallel slot and unused tokens, when it ends
    if stream.req.is_finished:                   # (it may have ended before on_done was set)
        grant.release(stream.req)
    if stream.req.is_finished and stream.req.error is not None and not stream.req.output_ids:
        m.rejections.labels(type(stream.req.error).__name__, "cluster").inc()
        return _failed(stream.req)               # refused at admission: a 4xx, streamed or not
    if cr.stream:
        return StreamingResponse(_sse(state, request, stream, chat, cr.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **(grant.headers or {})})
    response = await _whole(state, request, stream, chat)
    response.headers.update(grant.headers or {})
    return response

async def _tokenize(state: State, request: Request):
    body = await _body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        tr = P.TokenizeRequest.model_validate(body)
    except ValidationError as e:
        return _validation(e)
    if (tr.prompt is None) == (tr.messages is None):
        return _err(400, "give exactly one of prompt or messages")
    text = tr.prompt if tr.prompt is not None else render_chat(state, tr.messages)
    try:
        ids = state.tokenizer.encode(text)
    except UnicodeEncodeError:
        return _err(400, "the prompt is not valid Unicode text")
    return {"tokens": ids, "count": len(ids), "max_model_len": state.context_length}

def operator_only(state: State, request: Request) -> JSONResponse | None:
    """/metrics and /server_info show every tenant's pseudonym and the cluster's shape: with
    --metrics-key they want that key (compared in constant time), else 401."""
    if state.metrics_key is None:
        return None
    given = request.headers.get("authorization", "")
    if hmac.compare_digest(given.encode(), f"Bearer {state.metrics_key}".encode()):
        return None
    return _err(401, "this endpoint wants the --metrics-key (Authorization: Bearer <key>)",
                "authentication_error", code="invalid_api_key")


def create_app(state: State) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.start_engine:
            state.loop.start()
        yield
        # uvicorn stopped accepting and waited for in-flight handlers; drain the engine, then let the
        # store flush and seal (on_shutdown), so a restart on the same store continues it
        await asyncio.to_thread(state.loop.stop, state.drain_s)
        for fn in state.on_shutdown:
            await asyncio.to_thread(fn)

    app = FastAPI(title="kvledger", lifespan=lifespan, docs_url=None, redoc_url=None)
    m = state.metrics

    app.add_middleware(CountResponses, counter=m.http)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(state, request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        if tenant_of(state, request) is None:
            return unauthorized()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvledger", "max_model_len": state.context_length}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        tenant = tenant_of(state, request)
        if tenant is None:
            return unauthorized()
        # a tokenize is a request like any other to the tenant's request rate (it costs CPU, and
        # answers how long a text is): charged before the body is read, its parallel slot given back after
        grant = state.limiter.admit(tenant.tenant, 0, 0)
        if isinstance(grant, Refusal):
            return _rate_limited(grant)
        try:
            return await _tokenize(state, request)
        finally:
            grant.release(None)

    @app.get("/health")
    async def health():
        alive = state.loop.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        if (refused := operator_only(state, request)) is not None:
            return refused
        text = generate_latest(m.registry)
        text += await state.loop.metrics_text()       # the engine's own metrics, from its process
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info(request: Request):
        if (refused := operator_only(state, request)) is not None:
            return refused
        return state.info

    return app


class CountResponses:
    """HTTP responses by route and status, as plain ASGI: Starlette's ``BaseHTTPMiddleware`` would
    hide the client's disconnect from the handlers (``request.is_disconnected()`` never turns true
    behind it), and a dropped non-streamed request would then run to its ``max_tokens``."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
        try:
            await self.app(scope, receive, send_counted)
        finally:
            if status:
                self.counter.labels(scope["path"] if scope["path"] in ROUTES else "other", str(status[0])).inc()


ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/health", "/metrics", "/server_info"}


DISCONNECT_CHECK_S = 0.25     # how often a non-streamed request looks for its client while tokens flow


async def _next(state: State, request: Request, stream: Stream, checked: list[float]):
    """The stream's next event; aborts the request when the client has gone away meanwhile - looked
    for while tokens keep coming too (every DISCONNECT_CHECK_S), not only when they pause, so a
    dropped client's request is let go within a step or two instead of running to max_tokens."""
    while True:
        try:
            ev = await asyncio.wait_for(stream.events.get(), timeout=DISCONNECT_CHECK_S)
        except asyncio.TimeoutError:
            ev = None
        now = time.monotonic()
        if ev is None or now - checked[0] >= DISCONNECT_CHECK_S:
            checked[0] = now
            if await request.is_disconnected():
                state.loop.abort(stream)
                return None
        if ev is not None:
            return ev


async def _whole(state: State, request: Request, stream: Stream, chat: bool):
    stream.final_only = True             # one wake-up, at the end (and one every DISCONNECT_CHECK_S)
    checked = [time.monotonic()]
    while True:
        ev = await _next(state, request, stream, checked)
        if ev is None:
            return Response(status_code=499)
        if ev[1]:
            break
    req = stream.req
    if (bad := _failed(req)) is not None:
        return bad
    body = (P.chat_completion if chat else P.completion)(req, state.model_name, state.tokenizer.decode(req.output_ids))
    return JSONResponse(body)


async def _sse(state: State, request: Request, stream: Stream, chat: bool, include_usage: bool):
    """Server-sent events; a client that disconnects cancels this generator, which aborts its request
    through the engine's abort path (the cluster's, in disaggregated mode)."""
    req, dec = stream.req, Decoder(state.tokenizer)
    # a token's chunk is the same JSON but for its text: built once, the text spliced in per token
    mark = "\x00kvledger-delta\x00"
    pre, post = json.dumps(P.chunk(req, state.model_name, chat, mark, None)).split(json.dumps(mark))
    try:
        if chat:
            first = P.chunk(req, state.model_name, True, None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield f"data: {json.dumps(first)}\n\n"
        while True:
            tokens, finished = await stream.events.get()
            delta = dec.add(tokens, final=finished)
            if finished:
                if req.error is not None:
                    status, body = (P.error(503, str(req.error), "server_error", "server_shutting_down")
                                    if str(req.error) == SHUTTING_DOWN else
                                    P.error(500, f"{type(req.error).__name__}: {req.error}", "internal_error"))
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                yield f"data: {json.dumps(P.chunk(req, state.model_name, chat, delta, P.finish_reason(req)))}\n\n"
                if include_usage:
                    yield f"data: {json.dumps(P.chunk(req, state.model_name, chat, None, None, with_usage=True))}\n\n"
                break
            if delta:
                yield f"data: {pre}{json.dumps(delta)}{post}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not req.is_finished:
            state.loop.abort(stream)


# ---- kvledger serve --------------------------------------------------------------------------------
def serve(c: ServeConfig, open_recorder: RecorderFactory) -> int:
    """The engine in its own process (``engine.server.remote``, recording through the recorder
    ``open_recorder`` opens there), the app under uvicorn in this one, until SIGTERM/SIGINT: then
    stop accepting, drain (bounded), flush and seal the store, exit 0."""
    import uvicorn

    from engine.models import load_tokenizer
    from engine.server.backend import ClusterSpec
    from engine.server.remote import RemoteLoop

    keys = ApiKeys.load(c.keys)                   # refused here, before the engine process is started
    ClusterSpec.load(c.config)
    tok = load_tokenizer(c.model)
    loop = RemoteLoop(c, open_recorder)
    metrics = ServerMetrics(lambda t: loop.pseudonyms.get(t, "unknown"), c.policy, {}, None, side="http")
    limiter = RateLimiter(Limits(c.tenant_rpm, c.tenant_tpm, c.tenant_max_parallel), keys.limits,
                          on_refuse=metrics.refused)
    state = State(loop, tok, c.model_name, keys, metrics, loop.info, loop.context_length, _chat_template(c.model),
                  c.drain_timeout, limiter, metrics_key=c.metrics_key)
    if c.policy == "vulnerable":
        print("kvledger: WARNING: serving under the VULNERABLE policy: every guard is off; prompts longer than a "
              "prefill pool may read other tenants' KV (the GLM-5.3 incident). Use it to reproduce, never for real "
              "tenants.", file=sys.stderr)
    if keys.table is None:
        print("kvledger: warning: no --keys file: every request is tenant 'default' (no tenant isolation to "
              "observe)", file=sys.stderr)
    print(f"kvledger serve: {c.mode}, {c.policy}, model {c.model_name}, store {c.store} (run {loop.info['boot']}) "
          f"on http://{c.host}:{c.port}/v1 (engine process {loop.proc.pid}, {c.torch_threads} torch "
          "thread(s))", file=sys.stderr)
    # uvicorn waits a little longer than the engine's drain: requests the drain cuts are answered
    # (503, OpenAI's shape) before uvicorn would cancel their handlers
    config = uvicorn.Config(create_app(state), host=c.host, port=c.port, log_level="warning",
                            timeout_graceful_shutdown=int(c.drain_timeout) + 3, access_log=False)
    server = uvicorn.Server(config)
    code = run_http(server, loop, c.drain_timeout)
    if code and not server.started:
        print(f"kvledger: error: the HTTP server could not start on {c.host}:{c.port} (see above)",
              file=sys.stderr)
    elif code:
        print(f"kvledger: error: the engine failed while serving: {loop.error}", file=sys.stderr)
    return code


def run_http(server, loop, drain_s: float = 30.0) -> int:
    """uvicorn on a thread, this (main) thread waiting on it. SIGTERM/SIGINT tell uvicorn to stop
    accepting and finish in-flight requests; its shutdown then stops the engine process (it drains
    and seals the store); exit 0. (uvicorn's own handlers would re-raise the signal after its
    shutdown and kill the process with it; a second signal forces the exit.) An engine process that
    dies stops the HTTP server too; one that never got to serve is stopped here."""
    import signal
    import threading

    def on_signal(signum, frame) -> None:
        if not server.should_exit:            # the first: the engine's drain clock starts with uvicorn's
            threading.Thread(target=loop.begin_drain, args=(drain_s,), daemon=True).start()
        server.force_exit = server.should_exit
        server.should_exit = True

    def on_dead() -> None:
        log.error("the engine process is gone: stopping the HTTP server")
        server.should_exit = True
    loop.on_dead = on_dead
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    freeze_heap()           # as vLLM's API server: the app is built; a full GC scan would stall every stream
    http = threading.Thread(target=server.run, name="kvledger-http")
    http.start()
    try:
        while http.is_alive():
            http.join(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not server.started:
        loop.stop(0)                          # the lifespan that would have stopped it never ran
        return 1
    # a second signal forces uvicorn out without its lifespan shutdown: the engine is still to be
    # stopped (no drain: the operator asked twice), so the store is sealed and the process exits
    loop.stop(0)                              # idempotent: a no-op after the lifespan's own stop
    return 0 if loop.error is None else 1


def _chat_template(model: str) -> str | None:
    if model == "recall":
        return None
    cfg = Path(model) / "tokenizer_config.json"
    try:
        t = json.loads(cfg.read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    return t if isinstance(t, str) else None
