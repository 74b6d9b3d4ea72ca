-- For every (response, donor) pair of exposure_slots: how many distinct keyed n-grams of the
-- donor's prompt the response's output repeats that are evidence of the donor's data (see
-- ../exposure_ngrams.sql for which count).
WITH pairs AS (
    SELECT DISTINCT response, donor FROM exposure_slots WHERE donor != -1
),
ng AS (
    SELECT incarnation, role, hash FROM ngrams
    WHERE incarnation IN (SELECT response FROM pairs UNION ALL SELECT donor FROM pairs)
),
candidates AS (
    SELECT DISTINCT m.response AS response, m.donor AS donor, o.hash AS hash
    FROM pairs AS m
    JOIN ng AS o ON o.incarnation = m.response
    JOIN ng AS p ON p.incarnation = m.donor AND p.hash = o.hash
    WHERE o.role = 'output' AND p.role = 'prompt'
      AND (m.response, o.hash) NOT IN (SELECT incarnation, hash FROM ng WHERE role = 'prompt')
),
common AS (
    SELECT n.hash AS hash
    FROM ngrams AS n JOIN requests AS r ON r.incarnation = n.incarnation
    WHERE n.role = 'prompt' AND n.hash IN (SELECT hash FROM candidates)
    GROUP BY n.hash
    HAVING uniqExact(r.tenant_h) >= 2
)
SELECT response, donor, count() AS shared_ngrams
FROM candidates
WHERE hash NOT IN (SELECT hash FROM common)
GROUP BY response, donor
