-- The n-gram evidence in steps (forensics/queries/evidence.py), step 3: exposure_ngrams.sql's
-- answer from the candidates (_candidates, step 2) and _hits - the ngrams rows of at least every
-- candidate hash (rows of other hashes are dropped here).
WITH candidates AS (
    SELECT response, donor, hash FROM _candidates
),
hits AS MATERIALIZED (
    SELECT n.incarnation, n.role, n.hash, r.tenant_h, r.arrived_at
    FROM _hits n JOIN requests r ON r.incarnation = n.incarnation
    WHERE n.hash IN (SELECT hash FROM candidates)
),
common AS MATERIALIZED (     -- two tenants or more: min <> max (no distinct count; NULLs ignored alike)
    SELECT hash FROM hits WHERE role = 'prompt' GROUP BY hash HAVING min(tenant_h) <> max(tenant_h)
),
early AS (
    SELECT hash, tenant_h, unnest(first2, recursive := true)     -- as rows (i, t): a plain join's conditions
    FROM (SELECT hash, tenant_h,
                 min_by({'i': incarnation, 't': arrived_at}, arrived_at, 2) AS first2
          FROM (SELECT DISTINCT hash, tenant_h, incarnation, arrived_at FROM hits
                ANTI JOIN common USING (hash))     -- a common hash's candidates go anyway: not its arrivals
          GROUP BY hash, tenant_h)
),
tenant_own AS (
    SELECT DISTINCT c.response, c.donor, c.hash
    FROM candidates c
    JOIN requests rr ON rr.incarnation = c.response
    JOIN early e ON e.hash = c.hash AND e.tenant_h = rr.tenant_h
    WHERE e.t < rr.arrived_at AND e.i <> c.response AND e.i <> c.donor
)
SELECT response, donor, count(*) AS shared_ngrams
FROM candidates
ANTI JOIN common USING (hash)
ANTI JOIN tenant_own USING (response, donor, hash)
GROUP BY ALL
