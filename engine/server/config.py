"""``ServeConfig``: everything ``kvledger serve`` was told, typed and frozen (vLLM's and
mini-sglang's ``ServerArgs``). Built by the serve command; the HTTP process and the engine process
both read it (it crosses the process boundary as it is), neither ever sees the command line."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str = "recall"
    policy: str = "hardened"
    mode: str = "unified"
    config: str | None = None          # cluster.toml (None: the glm53 cluster)
    keys: str | None = None            # the API keys file (None: every caller is tenant 'default')
    host: str = "127.0.0.1"
    port: int = 8000
    store: str = "./kvledger-store"    # where the recorder writes (named in messages; the recorder holds it)
    max_pending: int = 256
    tenant_rpm: int = 0
    tenant_tpm: int = 0
    tenant_max_parallel: int = 0
    drain_timeout: float = 30.0
    torch_threads: int = 1
    metrics_key: str | None = None     # when set, /metrics and /server_info want "Authorization: Bearer <it>"
    max_num_seqs: int = 128            # sequences a node runs at once (vLLM's CPU server default)
    max_num_batched_tokens: int = 2048  # tokens a node's step may hold: decodes + prefill chunks (vLLM CPU server's)
    dtype: str = "float32"             # how the weights and the KV pools are stored (bfloat16: half the bytes)

    @property
    def model_name(self) -> str:
        """The name ``/v1/models`` lists: ``recall``, or the model directory's name."""
        from pathlib import Path
        return "recall" if self.model == "recall" else Path(self.model).name
