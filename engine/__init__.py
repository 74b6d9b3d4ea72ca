"""kvledger engine: a paged-attention inference engine whose KV slots carry who wrote them.

Where things are:
- ``engine/kv/``           KV memory: pool (K/V and the tag plane in one buffer), allocator
                           (pages, generations, ``check_integrity()``), block manager, prefix
                           cache, host tier, preflight (pool vs context at start)
- ``engine/tags.py``       content tags: the keyed hash chain over a request's own prefix
- ``engine/attention.py``  the paged-attention op; the read check lives here
- ``engine/request.py``    the request state machine and its single terminal predicate
- ``engine/scheduler.py``  continuous batching, chunked prefill, preemption
- ``engine/runner.py``     builds slot mappings and block tables, runs a model step
- ``engine/llm.py``        the public entry point, ``LLMEngine``
- ``engine/recorder.py``   what the engine tells a recorder (the contract; it is handed one)
- ``engine/disagg/``       prefill/decode disaggregation: guards, the KV link, the cluster, processes
- ``engine/replay/``       the incident lab: the glm53 replay, the bug family, the oracle
- ``engine/server/``       ``kvledger serve``: the OpenAI-compatible server above the engine
- ``engine/commands/``     the engine's commands and the ``kvledger`` entry point (``main.py``)
"""
from engine.errors import KvledgerError, InputError, ReadCheckViolation  # noqa: F401
