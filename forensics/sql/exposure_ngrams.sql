-- For every (response, donor) pair of exposure_slots: how many distinct keyed n-grams of the
-- donor's prompt the response's output repeats that are evidence of the donor's data ("surfaced"
-- when > 0). An n-gram counts only when it is
--   - in the donor's prompt, in slots the response read from that donor (the n-gram's positions in
--     the donor's prompt meet the donor positions of those slots; stores written before n-grams had
--     positions: anywhere in the prompt), and in the response's output;
--   - evidence at all: the ledger hashes only n-grams with at least 4 distinct tokens holding a
--     letter or digit (never a run of spaces, punctuation or one repeated token);
--   - not in the response's own prompt (a response repeating its own prompt proves nothing);
--   - not in another request of the response's own tenant that arrived before it (prompt or
--     output): the text may have come to the response through its tenant's own traffic;
--   - not common across the store: common = in the prompts of requests of 2 or more distinct
--     tenants (boilerplate, templates, system prompts; a tenant's secret is in its own prompts only).
-- It does not depend on the window, so it is materialised once per snapshot, beside exposure_slots;
-- ngrams is scanned for the pairs' incarnations, and again only for the candidate hashes.
-- A response the read check stopped (blocked: never an exposure) is not a pair: its evidence is
-- 'blocked' whatever its output holds, so its n-grams are never read (in a hardened fleet most
-- failing reads are blocked ones, and this keeps the ngrams scan to the real exposures).
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
),
pairs AS (
    SELECT DISTINCT response, donor FROM exposure_slots ANTI JOIN blocked USING (response) WHERE donor <> -1
),
read_pos AS (  -- the donor positions whose KV each response read
    SELECT DISTINCT response, donor, donor_position FROM exposure_slots ANTI JOIN blocked USING (response)
    WHERE donor <> -1 AND donor_position IS NOT NULL
),
ng AS MATERIALIZED (
    SELECT incarnation, role, hash, n, pos FROM ngrams
    WHERE incarnation IN (SELECT response FROM pairs UNION SELECT donor FROM pairs)
),
candidates AS MATERIALIZED (
    SELECT * FROM (
        SELECT DISTINCT m.response, m.donor, o.hash
        FROM pairs m
        JOIN ng o ON o.incarnation = m.response AND o.role = 'output'
        JOIN ng p ON p.incarnation = m.donor AND p.role = 'prompt' AND p.hash = o.hash
        WHERE p.pos IS NULL OR EXISTS (
            SELECT 1 FROM read_pos r
            WHERE r.response = m.response AND r.donor = m.donor AND r.donor_position BETWEEN p.pos AND p.pos + p.n - 1)
    ) c
    ANTI JOIN (SELECT incarnation AS response, hash FROM ng WHERE role = 'prompt') own USING (response, hash)
),
hits AS MATERIALIZED (   -- every request holding a candidate hash, with its tenant and arrival
    SELECT n.incarnation, n.role, n.hash, r.tenant_h, r.arrived_at
    FROM ngrams n JOIN requests r ON r.incarnation = n.incarnation
    WHERE n.hash IN (SELECT hash FROM candidates)
),
common AS (
    SELECT hash FROM hits WHERE role = 'prompt' GROUP BY hash HAVING count(DISTINCT tenant_h) >= 2
),
tenant_own AS (  -- the response's tenant had the text in an earlier request of its own
    SELECT DISTINCT c.response, c.donor, c.hash
    FROM candidates c
    JOIN requests rr ON rr.incarnation = c.response
    JOIN hits h ON h.hash = c.hash AND h.tenant_h = rr.tenant_h AND h.arrived_at < rr.arrived_at
                AND h.incarnation <> c.response AND h.incarnation <> c.donor
)
SELECT response, donor, count(*) AS shared_ngrams
FROM candidates
ANTI JOIN common USING (hash)
ANTI JOIN tenant_own USING (response, donor, hash)
GROUP BY ALL
