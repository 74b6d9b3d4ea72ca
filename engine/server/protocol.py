"""Request and response shapes of the OpenAI API subset ``kvledger serve`` speaks.

Unknown fields are refused by name (400): a client asking for something this server does not do
(``n > 1``, ``logprobs``, ``stop``...) learns so, instead of getting an answer to another question.
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

MAX_TOKENS_LIMIT = 4096          # per request; the context length bounds it further
MAX_BODY_BYTES = 1 << 20         # request body limit (413 above it)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: StrictInt | None = Field(default=None, ge=0, lt=1 << 63)
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1
    user: str | None = Field(default=None, max_length=256)        # narrows the cache scope, never widens it
    cache_salt: str | None = Field(default=None, max_length=256)  # (vLLM's extension) narrows it too
    frequency_penalty: Literal[0, 0.0] | None = None
    presence_penalty: Literal[0, 0.0] | None = None
    logprobs: Literal[False] | None = None
    logit_bias: None = None
    stop: None = None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[StrictInt]
    max_tokens: StrictInt | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty: at least one token is required")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Literal[False] | None = None
    top_logprobs: None = None

    @property
    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


def usage(req) -> dict:
    """``prompt_tokens`` is what is billed; ``cached_tokens`` what came from the prefix cache. Under
    ``vulnerable`` the incident's dishonesty shows here exactly as clients saw it: billed for the
    whole prompt while one placeholder token was prefilled."""
    return {"prompt_tokens": req.prompt_tokens_billed, "completion_tokens": len(req.output_ids),
            "total_tokens": req.prompt_tokens_billed + len(req.output_ids),
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def response_id(prefix: str, incarnation: int) -> str:
    """One id format everywhere: the incarnation in decimal, as the store's `incarnation` column,
    every forensic query and the span's gen_ai.response.id show it."""
    return f"{prefix}-{incarnation}"


def completion(req, model: str, text: str) -> dict:
    return {"id": response_id("cmpl", req.incarnation), "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish_reason(req)}], "usage": usage(req)}


def chat_completion(req, model: str, text: str) -> dict:
    return {"id": response_id("chatcmpl", req.incarnation), "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason(req)}], "usage": usage(req)}


def chunk(req, model: str, chat: bool, delta: str | None, finish: str | None, with_usage: bool = False) -> dict:
    if chat:
        d = {} if delta is None else {"content": delta}
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        body = {"id": response_id("chatcmpl", req.incarnation), "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        body = {"id": response_id("cmpl", req.incarnation), "object": "text_completion"}
    body.update({"created": int(time.time()), "model": model, "choices": [] if with_usage else [choice]})
    if with_usage:
        body["usage"] = usage(req)
    return body


def finish_reason(req) -> str:
    return "stop" if req.finish_reason == "stop" else "length"


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}
