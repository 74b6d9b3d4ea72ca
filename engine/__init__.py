"""kvledger engine: a paged-attention inference engine whose KV slots carry who wrote them.

Where things are:
- ``engine/pool.py``       the page pool: K/V and the tag plane in one buffer
- ``engine/allocator.py``  pages, generations, ``check_integrity()``
- ``engine/tags.py``       content tags: the keyed hash chain over a request's own prefix
- ``engine/attention.py``  the paged-attention op; the read check lives here
- ``engine/request.py``    the request state machine and its single terminal predicate
- ``engine/scheduler.py``  continuous batching, chunked prefill, preemption
- ``engine/runner.py``     builds slot mappings and block tables, runs a model step
- ``engine/llm.py``        the public entry point, ``LLMEngine``
- ``engine/prefix_cache.py`` tenant-scoped prefix cache (pages shared by content tag)
- ``engine/disagg.py``     prefill/decode disaggregation, the KV link, the guards
- ``engine/procs.py``      process mode: prefill nodes as OS processes, decode's pool in shared memory
- ``engine/scenarios.py``, ``engine/faults.py``  the glm53 replay and the bug family's replays
- ``engine/oracle.py``     the ground truth every accuracy test compares against
"""
from engine.errors import KvledgerError, InputError, ReadCheckViolation  # noqa: F401
