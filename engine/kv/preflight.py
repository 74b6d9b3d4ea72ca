"""Preflight: a node's KV pool capacity in tokens against the context length it advertises.

The incident's precondition was a pool (681,280 tokens) smaller than the context (1,048,576): a
prompt could be valid for the model and still not fit the pool. ``EngineConfig.preflight`` says
what a node does about it at start, before its pool is allocated:
    record   start, and record the mismatch (vulnerable)
    refuse   raise PreflightError naming the pool, the context and both ways out (hardened)
    fit      lower this node's context length to its pool, and record that (hardened, operator's choice)
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.errors import InputError
from engine.kv.pool import KVPool

MODES = ("record", "refuse", "fit")


class PreflightError(InputError):
    pass


class Preflight(NamedTuple):
    node: str
    role: str
    pool_tokens: int
    context_length: int          # after `fit`, the lowered one
    advertised_context: int
    fits: bool                   # pool_tokens >= advertised_context
    action: str                  # ok | recorded | lowered


def pool_tokens_for(model, cfg: EngineConfig) -> int:
    dtype = getattr(model, "dtype", torch.float32)
    page = KVPool.page_bytes_for(model.num_layers, model.kv_dim, cfg.page_size, dtype)
    return cfg.kv_memory_budget // page * cfg.page_size


def preflight(model, cfg: EngineConfig) -> Preflight:
    """Check (and, with `fit`, adjust) cfg before any pool memory is taken."""
    if cfg.preflight not in MODES:
        raise InputError(f"preflight must be one of {MODES}, got {cfg.preflight!r}")
    pool, ctx = pool_tokens_for(model, cfg), cfg.context_length
    if pool >= ctx:
        return Preflight(cfg.node_id, cfg.role, pool, ctx, ctx, True, "ok")
    if cfg.preflight == "refuse":
        raise PreflightError(f"node {cfg.node_id}: KV pool holds {pool} tokens, less than the context length {ctx}; "
                             f"a valid prompt could exceed the pool. Lower the context length to <= {pool} or raise "
                             f"the KV memory budget (refusing to start: preflight=refuse)")
    if cfg.preflight == "fit":
        cfg.context_length = pool
        return Preflight(cfg.node_id, cfg.role, pool, pool, ctx, False, "lowered")
    return Preflight(cfg.node_id, cfg.role, pool, ctx, ctx, False, "recorded")
