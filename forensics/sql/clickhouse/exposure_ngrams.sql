-- For every (response, donor) pair of exposure_slots: how many distinct keyed n-grams of the
-- donor's prompt the response's output repeats that are evidence of the donor's data (see
-- ../exposure_ngrams.sql for which count).
WITH pairs AS (      -- blocked responses (the read check stopped them) are never exposures: not pairs
    SELECT DISTINCT response, donor FROM exposure_slots
    WHERE donor != -1 AND response NOT IN (SELECT incarnation FROM requests WHERE error_type = 'ReadCheckViolation')
),
read_pos AS (
    SELECT DISTINCT response, donor, donor_position FROM exposure_slots
    WHERE donor != -1 AND donor_position IS NOT NULL
      AND response NOT IN (SELECT incarnation FROM requests WHERE error_type = 'ReadCheckViolation')
),
ng AS (
    SELECT incarnation, role, hash, n, pos FROM ngrams
    WHERE incarnation IN (SELECT response FROM pairs UNION ALL SELECT donor FROM pairs)
),
matched AS (
    SELECT DISTINCT m.response AS response, m.donor AS donor, o.hash AS hash, p.pos AS pos, toInt64(p.n) AS n
    FROM pairs AS m
    JOIN ng AS o ON o.incarnation = m.response
    JOIN ng AS p ON p.incarnation = m.donor AND p.hash = o.hash
    WHERE o.role = 'output' AND p.role = 'prompt'
      AND (m.response, o.hash) NOT IN (SELECT incarnation, hash FROM ng WHERE role = 'prompt')
),
candidates AS (
    SELECT DISTINCT c.response AS response, c.donor AS donor, c.hash AS hash
    FROM matched AS c
    LEFT JOIN read_pos AS r ON r.response = c.response AND r.donor = c.donor
    WHERE c.pos IS NULL OR (r.donor_position >= c.pos AND r.donor_position <= c.pos + c.n - 1)
),
hits AS (
    SELECT n.incarnation AS incarnation, n.role AS role, n.hash AS hash, r.tenant_h AS tenant_h, r.arrived_at AS arrived_at
    FROM ngrams AS n JOIN requests AS r ON r.incarnation = n.incarnation
    WHERE n.hash IN (SELECT hash FROM candidates)
),
common AS (
    SELECT hash FROM hits WHERE role = 'prompt' GROUP BY hash HAVING uniqExact(tenant_h) >= 2
),
early AS (   -- per (hash, tenant): the two requests holding it that arrived first - enough to know whether one
    SELECT hash, tenant_h,     -- other than the response and its donor arrived before the response (a hash
           groupArraySorted(2)((arrived_at, incarnation)) AS first2   -- common to many requests never fans out)
    FROM (SELECT DISTINCT hash, tenant_h, incarnation, arrived_at FROM hits)
    GROUP BY hash, tenant_h
),
tenant_own AS (
    SELECT DISTINCT c.response AS response, c.donor AS donor, c.hash AS hash
    FROM candidates AS c
    JOIN requests AS rr ON rr.incarnation = c.response
    JOIN early AS e ON e.hash = c.hash AND e.tenant_h = rr.tenant_h
    WHERE arrayExists(x -> x.1 < rr.arrived_at AND x.2 != c.response AND x.2 != c.donor, e.first2)
)
SELECT response, donor, count() AS shared_ngrams
FROM candidates
WHERE hash NOT IN (SELECT hash FROM common)
  AND (response, donor, hash) NOT IN (SELECT response, donor, hash FROM tenant_own)
GROUP BY response, donor
