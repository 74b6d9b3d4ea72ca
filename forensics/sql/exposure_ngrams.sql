-- For every (response, donor) pair of exposure_slots: how many distinct keyed n-grams of the
-- donor's prompt the response's output repeats that are evidence of the donor's data ("surfaced"
-- when > 0). An n-gram counts only when it is
--   - in the donor's prompt and in the response's output,
--   - not in the response's own prompt (a response repeating its own prompt proves nothing), and
--   - not common across the store: common = in the prompts of requests of 2 or more distinct
--     tenants (boilerplate, templates, system prompts; a tenant's secret is in its own prompts only).
-- It does not depend on the window, so it is materialised once per snapshot, beside exposure_slots;
-- ngrams is scanned for the pairs' incarnations, and again only for the candidate hashes.
WITH pairs AS (
    SELECT DISTINCT response, donor FROM exposure_slots WHERE donor <> -1
),
ng AS MATERIALIZED (
    SELECT incarnation, role, hash FROM ngrams
    WHERE incarnation IN (SELECT response FROM pairs UNION SELECT donor FROM pairs)
),
candidates AS MATERIALIZED (
    SELECT * FROM (
        SELECT DISTINCT m.response, m.donor, o.hash
        FROM pairs m
        JOIN ng o ON o.incarnation = m.response AND o.role = 'output'
        JOIN ng p ON p.incarnation = m.donor AND p.role = 'prompt' AND p.hash = o.hash
    ) c
    ANTI JOIN (SELECT incarnation AS response, hash FROM ng WHERE role = 'prompt') own USING (response, hash)
),
common AS (
    SELECT n.hash
    FROM ngrams n JOIN requests r ON r.incarnation = n.incarnation
    WHERE n.role = 'prompt' AND n.hash IN (SELECT hash FROM candidates)
    GROUP BY n.hash
    HAVING count(DISTINCT r.tenant_h) >= 2
)
SELECT response, donor, count(*) AS shared_ngrams
FROM candidates ANTI JOIN common USING (hash)
GROUP BY ALL
