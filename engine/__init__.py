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
"""
from engine.errors import KvledgerError, InputError, ReadCheckViolation  # noqa: F401
