-- The n-gram evidence in steps (forensics/queries/evidence.py): a digest of the requests step 3 joins
-- (tenant and arrival of every request holding a candidate hash, and of every candidate's response):
-- a request that finished since (its arrival now from its root span) or any other change shows here.
SELECT count(*) AS n, coalesce(bit_xor(hash(incarnation, tenant_h, arrived_at)), 0) AS digest
FROM requests
WHERE incarnation IN (SELECT incarnation FROM _hits UNION SELECT response FROM _candidates)
