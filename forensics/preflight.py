"""Pool against context for engines that are not ours: from their start-up logs (parsed by
``telemetry/receivers/foreign_logs.py``) or from the running server. Each instance (a rank, a
process, a node of a PD router) is judged on its own.

From a running server (``--endpoint``), in order:
- ours and SGLang: ``/server_info`` (SGLang also ``/get_server_info``): ``max_total_num_tokens``
  and ``context_length``; when SGLang reports no context there, ``/v1/models``' ``max_model_len``.
  A PD router's ``{"prefill": [...], "decode": [...]}`` is judged node by node.
- vLLM: the pool from ``/metrics`` (``vllm:cache_config_info``: ``kv_cache_size_tokens``, else
  ``num_gpu_blocks`` x ``block_size``), the context from ``/v1/models`` (``max_model_len``), the
  version from ``/version``.
The engine's version is reported; an SGLang older than 0.5.22 serving disaggregated (the release
with the incident's admission fixes, sgl-project/sglang#36988 and #38935) is a finding by itself.
"""
from __future__ import annotations

import re
from pathlib import Path

from telemetry.receivers.foreign_logs import Instance, parse_sglang, parse_vllm

SGLANG_FIXED = (0, 5, 22)


def from_log(path: str, engine: str) -> list[Instance]:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise ValueError(f"--{engine}-log {path}: {e.strerror}") from None
    found = parse_vllm(text) if engine == "vllm" else parse_sglang(text)
    if not found:
        what = ("'<device> KV cache size: N tokens' or '# <device> blocks: N'" if engine == "vllm"
                else "'max_total_num_tokens=N'")
        raise ValueError(f"--{engine}-log {path}: no capacity line found (expected {what}); is it the engine's "
                         "start-up log?")
    return [judge_release(i) for i in found]


def _version(text: str | None) -> tuple[int, ...] | None:
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g or 0) for g in m.groups()) if m else None


def judge_release(i: Instance, disaggregated: bool | None = None) -> Instance:
    """An SGLang release before the admission fixes, serving disaggregated, is a finding."""
    disagg = disaggregated if disaggregated is not None else "node)" in i.source
    v = _version(i.version)
    if i.engine == "sglang" and disagg and v is not None and v < SGLANG_FIXED:
        return i._replace(finding=f"SGLang {i.version} serves disaggregated without the incident's admission fixes "
                                  "(sgl-project/sglang#36988, #38935; upgrade to 0.5.22 or later)")
    return i


def _get(http, url: str):
    """(status, body as JSON or text) or (None, None) when nothing answers there."""
    import httpx
    try:
        r = http.get(url)
    except httpx.HTTPError:
        return None, None
    if r.status_code != 200:
        return r.status_code, None
    try:
        return 200, r.json()
    except ValueError:
        return 200, r.text


def _sglang(info: dict, name: str, source: str, context_fallback: int | None, disagg: bool | None) -> Instance:
    pool = info.get("max_total_num_tokens")
    ctx = info.get("context_length") or info.get("context_len") or context_fallback
    mode = info.get("disaggregation_mode")
    if disagg is None:
        disagg = mode in ("prefill", "decode")
    i = Instance(name, int(pool) if pool is not None else None, int(ctx) if ctx else None,
                 source + (f" ({mode} node)" if mode in ("prefill", "decode") else ""), "sglang",
                 str(info["version"]) if info.get("version") else None)
    return judge_release(i, disagg)


def from_endpoint(url: str) -> list[Instance]:
    """Every instance a running engine (ours, SGLang, an SGLang PD router, vLLM) reports."""
    import httpx
    root = url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    with httpx.Client(timeout=10) as http:
        try:
            http.get(root + "/health")
        except httpx.HTTPError as e:
            raise ValueError(f"--endpoint {url}: cannot connect ({e})") from None
        _, models = _get(http, root + "/v1/models")
        listed = models.get("data") if isinstance(models, dict) else None
        max_model_len = next((m.get("max_model_len") for m in listed or [] if isinstance(m, dict)
                              and m.get("max_model_len")), None)
        for path in ("/server_info", "/get_server_info"):
            status, info = _get(http, root + path)
            if not isinstance(info, dict):
                continue
            if isinstance(info.get("nodes"), list):          # ours: each node judged on its own
                return [Instance(n["node_id"], n["pool_tokens"], n["context_length"], f"{path} (kvledger)",
                                 "kvledger", info.get("version")) for n in info["nodes"]]
            if isinstance(info.get("prefill"), list) or isinstance(info.get("decode"), list):   # SGLang PD router
                out = []
                for role in ("prefill", "decode"):
                    for k, node in enumerate(info.get(role) or []):
                        if isinstance(node, dict):
                            out.append(_sglang(node, f"{role}#{k}", f"{path} (PD router)", max_model_len, True))
                if out:
                    return out
            if "max_total_num_tokens" in info:
                return [_sglang(info, "server", path, max_model_len, None)]
        # vLLM: no server info; its pool is in /metrics, its context in /v1/models
        from telemetry.receivers.prometheus import engine_metrics, parse
        _, version = _get(http, root + "/version")
        status, page = _get(http, root + "/metrics")
        metrics = None
        if isinstance(page, str):
            try:
                metrics = engine_metrics(parse(page))
            except ValueError:
                metrics = None
        if metrics is not None and metrics.engine == "vllm":
            v = version.get("version") if isinstance(version, dict) else None
            return [Instance("vllm", metrics.pool_tokens, max_model_len,
                             "/metrics, /v1/models", "vllm", v)]
        if metrics is not None and metrics.engine == "sglang":
            return [Instance("sglang", metrics.pool_tokens, max_model_len,
                             "/metrics, /v1/models", "sglang")]
    raise ValueError(f"--endpoint {url}: no pool found: neither /server_info, /get_server_info nor /metrics "
                     "(vllm:cache_config_info, sglang:max_total_num_tokens) report one there; is it an engine's "
                     "base URL? (or use --vllm-log / --sglang-log)")
