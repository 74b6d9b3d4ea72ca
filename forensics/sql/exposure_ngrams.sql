-- For every (response, donor) pair of exposure_slots: how many keyed n-grams of the response's
-- output occur in the donor's prompt ("surfaced" when > 0). It does not depend on the window, so it
-- is materialised once per snapshot, beside exposure_slots; ngrams is scanned once, for the pairs'
-- incarnations only.
WITH pairs AS (
    SELECT DISTINCT response, donor FROM exposure_slots
),
ng AS MATERIALIZED (
    SELECT incarnation, role, hash FROM ngrams
    WHERE incarnation IN (SELECT response FROM pairs UNION SELECT donor FROM pairs)
)
SELECT m.response, m.donor, count(*) AS shared_ngrams
FROM pairs m
JOIN ng o ON o.incarnation = m.response AND o.role = 'output'
JOIN ng p ON p.incarnation = m.donor AND p.role = 'prompt' AND p.hash = o.hash
GROUP BY ALL
