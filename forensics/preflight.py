"""Pool against context for engines that are not ours: from their start-up logs (parsed by
``telemetry/receivers/foreign_logs.py``) or their server info (``/server_info``, SGLang's
``/get_server_info``). Each instance (a rank or a process) is judged on its own."""
from __future__ import annotations

from pathlib import Path

from telemetry.receivers.foreign_logs import Instance, parse_sglang, parse_vllm

def from_log(path: str, engine: str) -> list[Instance]:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise ValueError(f"--{engine}-log {path}: {e.strerror}") from None
    found = parse_vllm(text) if engine == "vllm" else parse_sglang(text)
    if not found:
        what = ("'GPU KV cache size: N tokens' or '# GPU blocks: N'" if engine == "vllm"
                else "'max_total_num_tokens=N'")
        raise ValueError(f"--{engine}-log {path}: no capacity line found (expected {what}); is it the engine's "
                         "start-up log?")
    return found


def from_endpoint(url: str) -> list[Instance]:
    """Our ``/server_info`` (every node), or SGLang's ``/server_info`` / ``/get_server_info``."""
    import httpx
    root = url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    for path in ("/server_info", "/get_server_info"):
        try:
            r = httpx.get(root + path, timeout=10)
        except httpx.HTTPError as e:
            raise ValueError(f"--endpoint {url}: cannot connect ({e})") from None
        if r.status_code != 200:
            continue
        try:
            info = r.json()
        except ValueError:
            continue
        if isinstance(info.get("nodes"), list):          # ours: each node judged on its own
            return [Instance(n["node_id"], n["pool_tokens"], n["context_length"], f"{path} (kvledger)")
                    for n in info["nodes"]]
        if "max_total_num_tokens" in info:
            return [Instance("server", int(info["max_total_num_tokens"]), info.get("context_length"), path)]
    raise ValueError(f"--endpoint {url}: neither /server_info nor /get_server_info reports max_total_num_tokens "
                     "(vLLM reports no pool there: use --vllm-log)")
