"""Disaggregated prefill/decode:

- ``guards.py``   ``Guards``: one switch per fix of the bug family (hardened: all on)
- ``link.py``     the KV link: paced one-sided record writes, ``LinkStatus`` of each transfer
- ``cluster.py``  the router, prefill nodes, decode node; decode's ``Verdict`` on each transfer
- ``procs.py``    process mode: prefill nodes as OS processes writing into decode's pool in shared memory
"""
from engine.disagg.cluster import DisaggCluster  # noqa: F401
from engine.disagg.guards import Guards  # noqa: F401
from engine.disagg.link import LinkConfig  # noqa: F401
