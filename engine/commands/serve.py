"""``kvledger serve``: the OpenAI-compatible server over the engine (or the cluster), recording
into the store. The command builds the ``ServeConfig`` and the recorder factory the engine
process opens its store with; the server never sees the command line."""
from __future__ import annotations

import os

from engine.commands.options import add_store, check_listen, check_port, check_range, check_writable_store
from engine.config import decode_path
from engine.errors import InputError
from engine.server.config import ServeConfig


def add_arguments(sv) -> None:
    sv.add_argument("--model", default="recall", help="'recall' (default) or an HF-format directory")
    sv.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="how the weights and the KV pools are stored (default float32; bfloat16: half the memory "
                         "and the bytes a decode step reads; products in bf16 where the CPU multiplies bf16 "
                         "(AVX512-BF16, AMX), else fp32 arithmetic; an HF checkpoint only)")
    sv.add_argument("--policy", choices=["vulnerable", "hardened"], default="hardened",
                    help="hardened (default): every guard on; vulnerable: the incident's behaviour, with a warning")
    sv.add_argument("--mode", choices=["unified", "disaggregated"], default="unified",
                    help="unified (default): one node; disaggregated: router, prefill nodes, decode node, KV link")
    sv.add_argument("--config", default=None, metavar="cluster.toml",
                    help="node pools, context length, page size, isolation level (default: the glm53 cluster)")
    sv.add_argument("--keys", default=None, metavar="FILE",
                    help='JSON {"api-key": "tenant"} or {"api-key": {"tenant":..., "user":..., "org":..., "rpm":..., '
                         '"tpm":..., "max_parallel_requests":...}}; unknown or missing key -> 401 (default: no keys, '
                         "every caller is tenant 'default')")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    add_store(sv, "where telemetry lands")
    sv.add_argument("--max-pending", type=int, default=256,
                    help="requests in flight before new ones get 429 with Retry-After (default 256)")
    sv.add_argument("--tenant-rpm", type=int, default=0, metavar="N",
                    help="requests per minute per tenant, for tenants whose keys entry sets no rpm (default 0: no "
                         "limit); over it -> 429 with Retry-After")
    sv.add_argument("--tenant-tpm", type=int, default=0, metavar="N",
                    help="tokens per minute per tenant (prompt + max_tokens, the unused part given back when the "
                         "request ends), for tenants whose keys entry sets no tpm (default 0: no limit)")
    sv.add_argument("--tenant-max-parallel", type=int, default=0, metavar="N",
                    help="requests in flight at once per tenant, for tenants whose keys entry sets no "
                         "max_parallel_requests (default 0: no limit beyond --max-pending)")
    sv.add_argument("--metrics-key", default=None, metavar="KEY",
                    help="a bearer key /metrics and /server_info then want (Prometheus: authorization: "
                         "credentials: KEY); default: none, both open (bind loopback, or set it)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM/SIGINT, seconds to let running requests finish before aborting them (default 30)")
    sv.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                    help="torch's intra-op threads for the engine (default: the cores less one, left to the HTTP "
                         "server, the store writer and local clients; each op waits for its slowest thread, so one "
                         "that loses its core stalls them all)")
    sv.add_argument("--max-num-seqs", type=int, default=128, metavar="N",
                    help="sequences each node runs at once; more wait in its queue (default 128, vLLM's CPU server "
                         "default)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                    help="tokens one engine step may hold, decodes plus prefill chunks; longer prompts are prefilled "
                         "in chunks (default 2048, vLLM's CPU server default)")


def make_config(a) -> ServeConfig:
    decode_path()                   # KVLEDGER_DECODE_KERNEL checked here: the engine's process inherits it
    from engine.server.limits import MAX_LIMIT
    check_port("--port", a.port)
    check_listen(a.host, ("--port", a.port))
    check_range("--max-pending", a.max_pending, 1, 1_000_000)
    check_range("--drain-timeout", a.drain_timeout, 0, 3600, " seconds")
    check_range("--torch-threads", a.torch_threads, 1, 1024)
    check_range("--max-num-seqs", a.max_num_seqs, 1, 4096)
    check_range("--max-num-batched-tokens", a.max_num_batched_tokens, 1, 1 << 20)
    for flag in ("tenant_rpm", "tenant_tpm", "tenant_max_parallel"):
        check_range(f"--{flag.replace('_', '-')}", getattr(a, flag), 0, MAX_LIMIT, " (0: no limit)")
    if a.metrics_key is not None and not 16 <= len(a.metrics_key) <= 512:
        raise InputError(f"--metrics-key must be 16 to 512 characters (got {len(a.metrics_key)}): a key that "
                         "short can be guessed")
    if a.dtype != "float32" and a.model == "recall":
        from engine.models import RECALL_DTYPE
        raise InputError(RECALL_DTYPE)
    check_writable_store(a.store)
    return ServeConfig(a.model, a.policy, a.mode, a.config, a.keys, a.host, a.port, a.store, a.max_pending,
                       a.tenant_rpm, a.tenant_tpm, a.tenant_max_parallel, a.drain_timeout, a.torch_threads,
                       a.metrics_key, a.max_num_seqs, a.max_num_batched_tokens, a.dtype)


def run(c: ServeConfig) -> int:
    from engine.server.app import serve
    from telemetry.recorder import recording
    return serve(c, recording(c.store, service="kvledger-serve"))
