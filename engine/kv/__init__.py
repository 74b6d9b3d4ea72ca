"""KV memory, state apart from policy (as vLLM's ``BlockPool`` / ``KVCacheManager``):

- ``pool.py``          the page pool: K/V and the tag plane in one preallocated buffer
- ``allocator.py``     free list, refcounts, page generations, ``check_integrity()``
- ``block_manager.py`` block tables, deferred release (``hold``)
- ``prefix_cache.py``  tenant-scoped prefix cache (pages shared by content tag)
- ``host.py``          the host tier (offload/reload as a DMA at the end of the step)
- ``preflight.py``     pool capacity against the context length at start: record, refuse or fit
"""
