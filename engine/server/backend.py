"""What ``kvledger serve`` serves with: tenants from API keys, the cluster file, and the backend.

Keys file (``--keys``): JSON ``{"api-key": "tenant"}`` or ``{"api-key": {"tenant": ..., "user": ...,
"org": ..., "rpm": ..., "tpm": ..., "max_parallel_requests": ...}}`` (the limits are the tenant's, shared
by all its keys: ``engine.server.limits``). The cache scope is derived server-side from those (engine.llm.LLMEngine.scope_for);
a client's ``user`` or ``cache_salt`` field may only narrow it.

Cluster file (``--config cluster.toml``), every key optional (defaults: the glm53 replay's cluster,
the incident's pool/context ratio on the small prefill node)::

    context_length = 1024
    page_size = 16
    isolation_level = "tenant"        # user | tenant | org | none (one global scope: for testing probes)
    prefix_cache = true               # unified: reuse full prompt pages within a cache scope
    [[prefill]]                       # disaggregated: one table per prefill node
    node_id = "prefill0"
    pool_tokens = 665
    [decode]
    pool_tokens = 2048
    [unified]
    pool_tokens = 2048
"""
from __future__ import annotations

import hmac
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from engine.config import EngineConfig
from engine.errors import InputError, KvledgerError
from engine.recorder import RecorderFactory, RunRecorder
from engine.server.config import ServeConfig
from engine.server.limits import Limits, parse_limits

INCIDENT_RATIO = 681_280 / 1_048_576
MAX_CONTEXT = 1 << 20


class Tenant(NamedTuple):
    tenant: str
    user: str = ""
    org: str = ""


class ApiKeys:
    """API key -> tenant. Compared in constant time; with no keys file every caller is 'default'."""

    def __init__(self, table: dict[str, Tenant] | None, limits: "dict[str, Limits] | None" = None):
        self.table = table
        self.limits = limits or {}        # tenant -> the rate limits its keys file entry sets

    @classmethod
    def load(cls, path: str | None) -> "ApiKeys":
        if path is None:
            return cls(None)
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise InputError(f"--keys {path}: {e.strerror}") from None
        except ValueError as e:
            raise InputError(f"--keys {path} is not JSON: {e}") from None
        if not isinstance(raw, dict) or not raw:
            raise InputError(f"--keys {path}: expected a JSON object of api-key -> tenant, got {type(raw).__name__}")
        table, limits = {}, {}
        for key, v in raw.items():
            if isinstance(v, str) and v:
                table[key] = Tenant(v)
            elif isinstance(v, dict) and isinstance(v.get("tenant"), str) and v["tenant"]:
                unknown = sorted(set(v) - KEY_FIELDS)
                if unknown:
                    raise InputError(f"--keys {path}: tenant {v['tenant']!r}: unknown field(s) {', '.join(unknown)} "
                                     f"(known: {', '.join(sorted(KEY_FIELDS))})")
                table[key] = Tenant(v["tenant"], str(v.get("user", "")), str(v.get("org", "")))
                lim = parse_limits(v, f"--keys {path}: tenant {v['tenant']!r}")
                if lim:
                    if limits.get(v["tenant"], lim) != lim:
                        raise InputError(f"--keys {path}: tenant {v['tenant']!r} has two keys with different rate "
                                         "limits (limits are the tenant's: give them once, or the same on every key)")
                    limits[v["tenant"]] = lim
            else:
                raise InputError(f"--keys {path}: the value for a key must be a tenant name or "
                                 '{"tenant": ..., "user": ..., "org": ..., "rpm": ..., "tpm": ..., '
                                 '"max_parallel_requests": ...}, got ' + repr(v)[:60])
        return cls(table, limits)

    def tenants(self) -> list[str]:
        return sorted({t.tenant for t in self.table.values()}) if self.table is not None else ["default"]

    def orgs(self) -> dict[str, str]:
        return {t.tenant: t.org for t in (self.table or {}).values() if t.org}

    def lookup(self, authorization: str | None) -> Tenant | None:
        if self.table is None:
            return Tenant("default")
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].encode()
        found = None
        for key, tenant in self.table.items():          # every key compared: no timing tells which matched
            if hmac.compare_digest(key.encode(), given):
                found = tenant
        return found


KEY_FIELDS = {"tenant", "user", "org", "rpm", "tpm", "max_parallel_requests"}
CLUSTER_KEYS = {"context_length", "page_size", "isolation_level", "prefix_cache", "prefill", "decode", "unified"}
NODE_KEYS = {"prefill": {"node_id", "pool_tokens"}, "decode": {"pool_tokens"}, "unified": {"pool_tokens"}}


def _known(where: str, table, known: set) -> None:
    """A cluster.toml table with only the keys this server reads (a typo is refused by name)."""
    if not isinstance(table, dict):
        raise InputError(f"{where} must be a table of {', '.join(sorted(known))}, got {type(table).__name__}")
    unknown = sorted(set(table) - known)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")


@dataclass
class ClusterSpec:
    context_length: int = 1024
    page_size: int = 16
    isolation_level: str = "tenant"
    prefix_cache: bool = True
    prefill: list[tuple[str, int]] = field(default_factory=list)   # (node id, pool tokens)
    decode_tokens: int = 0
    unified_tokens: int = 0

    @classmethod
    def load(cls, path: str | None) -> "ClusterSpec":
        raw = {}
        if path is not None:
            try:
                raw = tomllib.loads(Path(path).read_text())
            except OSError as e:
                raise InputError(f"--config {path}: {e.strerror}") from None
            except tomllib.TOMLDecodeError as e:
                raise InputError(f"--config {path} is not TOML: {e}") from None
            _known(f"--config {path}", raw, CLUSTER_KEYS)
            for name in ("decode", "unified"):
                if name in raw:
                    _known(f"--config {path}: [{name}]", raw[name], NODE_KEYS[name])
            if isinstance(raw.get("prefill"), list):
                for i, node in enumerate(raw["prefill"]):
                    _known(f"--config {path}: [[prefill]] #{i + 1}", node, NODE_KEYS["prefill"])
        spec = cls(context_length=_int(raw, "context_length", 1024, 16, MAX_CONTEXT),
                   page_size=_int(raw, "page_size", 16, 1, 4096), isolation_level=str(raw.get("isolation_level", "tenant")),
                   prefix_cache=bool(raw.get("prefix_cache", True)))
        if spec.isolation_level not in ("user", "tenant", "org", "none"):
            raise InputError("cluster config: isolation_level must be user, tenant, org or none (one global scope: "
                             f"tenants share the prefix cache), got {spec.isolation_level!r}")
        C = spec.context_length
        pre = raw.get("prefill", [{"node_id": "prefill0", "pool_tokens": round(C * INCIDENT_RATIO)},
                                  {"node_id": "prefill1-canary", "pool_tokens": 2 * C}])
        if not isinstance(pre, list) or not pre:
            raise InputError(f"--config {path}: [[prefill]] must list at least one prefill node")
        spec.prefill = [(str(p.get("node_id", f"prefill{i}")), _int(p, "pool_tokens", 2 * C, spec.page_size, 1 << 26))
                        for i, p in enumerate(pre)]
        spec.decode_tokens = _int(raw.get("decode", {}), "pool_tokens", 2 * C, spec.page_size, 1 << 26)
        spec.unified_tokens = _int(raw.get("unified", {}), "pool_tokens", 2 * C, spec.page_size, 1 << 26)
        return spec


class Built(NamedTuple):
    """What the engine process serves with (``build_engine``)."""
    backend: object                   # LLMEngine or DisaggCluster: an engine.server.loop.Backend
    recorder: RunRecorder
    metrics: object                   # engine.server.metrics.ServerMetrics, the engine side
    info: dict                        # /server_info
    context_length: int               # the longest context any node advertises


def _int(table: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = table.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InputError(f"cluster config: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def build_backend(model, tokenizer, mode: str, policy: str, spec: ClusterSpec, keys: ApiKeys, recorder, *,
                  max_num_seqs: int = 128, max_num_batched_tokens: int = 2048):
    """The engine (unified) or the cluster (router, prefill nodes, decode node, KV link) to serve with;
    each node runs up to ``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens a step."""
    from engine.disagg.cluster import DisaggCluster, Guards
    from engine.llm import LLMEngine
    guards = Guards.policy(policy)
    import torch

    from engine.kv.pool import KVPool
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, spec.page_size, getattr(model, "dtype", torch.float32))

    def cfg(tokens: int, node: str, prefix_cache: bool = False) -> EngineConfig:
        return EngineConfig(prefix_cache=prefix_cache, kv_memory_budget=(tokens // spec.page_size) * pb,
                            page_size=spec.page_size,
                            context_length=spec.context_length, node_id=node, max_num_seqs=max_num_seqs,
                            max_step_tokens=max_num_batched_tokens, check_reads=True,
                            fail_on_violation=guards.read_check, isolation_level=spec.isolation_level,
                            orgs=keys.orgs(), preflight="fit" if policy == "hardened" else "record")
    try:
        if mode == "unified":
            return LLMEngine(model, tokenizer, cfg(spec.unified_tokens, "unified0", spec.prefix_cache), recorder=recorder)
        return DisaggCluster(model, tokenizer, [cfg(t, n) for n, t in spec.prefill], cfg(spec.decode_tokens, "decode0"),
                             guards, recorder=recorder)
    except KvledgerError:
        raise
    except (ValueError, RuntimeError) as e:
        raise InputError(f"cannot build the {mode} cluster: {e}") from None


def build_engine(c: ServeConfig, open_recorder: RecorderFactory) -> Built:
    """Everything the engine owns, from serve's config: the backend, its recorder (opened through
    ``open_recorder``, handed down by the serve command), the engine-side metrics, the server info
    and the context length advertised. Runs in the engine process."""
    from dataclasses import asdict

    from engine.disagg import Guards
    from engine.models import load_model
    from engine.server.metrics import ServerMetrics

    keys = ApiKeys.load(c.keys)
    spec = ClusterSpec.load(c.config)
    model, tok = load_model(c.model, c.dtype)
    guards = asdict(Guards.policy(c.policy)) if c.mode == "disaggregated" else {
        "read_check": Guards.policy(c.policy).read_check}
    tel = open_recorder(policy=c.policy, guards=guards, isolation_level=spec.isolation_level, model_name=c.model_name)
    try:
        backend = build_backend(model, tok, c.mode, c.policy, spec, keys, tel, max_num_seqs=c.max_num_seqs,
                                max_num_batched_tokens=c.max_num_batched_tokens)
    except BaseException:
        tel.close()
        raise
    metrics = ServerMetrics(tel.pseudonym, c.policy, guards, tel, side="engine")
    nodes = backend.nodes
    for n in nodes:
        metrics.observe_node(n)
    metrics.known_tenants(keys.tenants())
    info = server_info(c, spec, nodes, guards, tel.boot)
    return Built(backend, tel, metrics, info, max(n.preflight.advertised_context for n in nodes))


def server_info(c: ServeConfig, spec, nodes, guards: dict, boot: str) -> dict:
    """Each node's pool against its context: what a probe or an operator checks (SGLang's
    ``max_total_num_tokens`` / ``context_length`` names at the top, for tools that read those)."""
    rows = [{"node_id": n.cfg.node_id, "role": n.cfg.role, "pool_tokens": n.pool.capacity_tokens,
             "context_length": n.cfg.context_length, "advertised_context": n.preflight.advertised_context,
             "page_size": n.cfg.page_size, "pool_fits_context": n.preflight.fits, "preflight": n.preflight.action,
             "max_num_seqs": n.cfg.max_num_seqs, "max_num_batched_tokens": n.cfg.max_step_tokens,
             "dtype": str(n.pool.dtype).removeprefix("torch.")}
            for n in nodes]
    admitting = [r for r in rows if r["role"] in ("prefill", "unified")]
    return {"model": c.model_name, "mode": c.mode, "policy": c.policy, "guards": guards, "boot": boot,
            "isolation_level": spec.isolation_level, "nodes": rows,
            "max_total_num_tokens": min(r["pool_tokens"] for r in admitting),
            "context_length": max(r["advertised_context"] for r in rows)}
