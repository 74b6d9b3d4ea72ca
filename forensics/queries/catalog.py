"""The one query catalogue: every name ``kvledger forensics`` answers, what it answers, and how the
ledger's questions fold onto a foreign fleet's spans. Each name is a SQL file in ``forensics/sql``
(DuckDB) and ``forensics/sql/clickhouse`` (ClickHouse), except ``fleet_tenants``, computed from
``fleet_ttft`` and ``fleet_impact`` (``fleet.py``). The CLI, the tests and the dashboard read the
names from here."""
from __future__ import annotations

QUERIES: dict[str, str] = {
    "runs": "the runs the store holds: boot id, policy, nodes, requests, exposed responses, first/last time",
    "exposures": "responses that read KV slots not written by their own chain, per donor (attention_mass: softmax "
                 "mass on the donor's pages summed over read steps; 1.0 = one step attending to nothing else)",
    "scores": "exposure score per response (README: Exposure score)",
    "tenant_scores": "exposure score per recipient tenant and --bucket window",
    "tenants": "donor -> recipient tenant matrix (pseudonyms)",
    "ttft": "time to first token vs uncached prompt tokens, the floor, and usage honesty",
    "impact": "responses whose billed prompt exceeds their prefill node's pool (the incident predicate)",
    "exploitation": "tenants sending abnormal volumes of over-pool or boundary-length prompts",
    "transfers": "KV transfers: reserved vs landed slot sets, checksums",
    "guards": "guard liveness: on, checks run, failures; red when on but idle",
    "releases": "page releases: immediate vs deferred, ended by drain or timeout",
    "preflight": "per node: KV pool tokens vs context length, policy, guards",
    "fleet_ttft": "foreign request spans: TTFT vs prompt tokens, Theil-Sen fit per instance, below_floor; "
                  "usage_dishonest where the engine reports the tokens it computed",
    "fleet_impact": "foreign request spans billed for more prompt than their instance's reported KV pool",
    "fleet_tenants": "foreign request spans per tenant: requests, below the TTFT floor, over the pool",
    "canary": "KV canary and KV checksum lines from foreign engines' logs, by instance and time",
    "cache_scopes": "block hashes a foreign engine stored under more than one cache scope (salt ignored)",
    "gaps": "telemetry known lost: KV event sequence gaps (filled from replay or not)",
    "probes": "external probe runs (`kvledger probe --store`): verdict and findings per check",
}
LEDGER_QUERIES = ["runs", "exposures", "scores", "tenant_scores", "tenants", "ttft", "transfers", "preflight",
                  "impact", "exploitation", "guards", "releases"]     # the page ledger's own (kvledger's requests)
COMPUTED = {"fleet_tenants"}                                          # no SQL file: computed in fleet.py
FOLDED = {"ttft": "fleet_ttft", "impact": "fleet_impact", "tenants": "fleet_tenants"}   # ledger name -> fleet twin
SOURCES = ("auto", "ledger", "spans")
