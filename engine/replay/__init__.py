"""The incident lab: real multi-tenant traffic through the engine, one triggering event, and the
oracle's verdict. Each replay is handed a recorder factory (never builds telemetry itself).

- ``glm53.py``   the GLM-5.3 incident, scaled (``glm53()``), the shared workload and ``ReplayResult``
- ``faults.py``  the rest of the bug family (faults 2-7), ``run_fault()``
- ``oracle.py``  the ground truth: a clean dense re-run of each response's own tokens
"""
from engine.replay.faults import FAULTS, MODES, run_fault  # noqa: F401
from engine.replay.glm53 import SCENARIOS, ReplayResult, glm53  # noqa: F401
