"""Disaggregated prefill/decode:

- ``cluster.py``  the router, prefill nodes, decode node, the KV link and the guards
- ``procs.py``    process mode: prefill nodes as OS processes writing into decode's pool in shared memory
"""
from engine.disagg.cluster import DisaggCluster, Guards, LinkConfig  # noqa: F401
