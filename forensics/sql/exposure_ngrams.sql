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
ro AS MATERIALIZED (   -- each pair's response output n-grams (joined on the response first: a pair
    SELECT DISTINCT m.response, m.donor, o.hash      -- is a few hundred rows, never a hash's fan-out)
    FROM pairs m JOIN ng o ON o.incarnation = m.response AND o.role = 'output'
),
matched AS MATERIALIZED (   -- ... that are in the donor's prompt, and where in it
    SELECT DISTINCT r.response, r.donor, r.hash, p.pos, p.n
    FROM ro r JOIN ng p ON p.incarnation = r.donor AND p.hash = r.hash AND p.role = 'prompt'
),
in_read AS (   -- the matched n-grams whose prompt positions meet a donor position the response read: each
    SELECT DISTINCT m.response, m.donor, m.hash   -- window's n positions, then one equality join
    FROM (SELECT response, donor, hash, unnest(range(pos, pos + n)) AS donor_position FROM matched
          WHERE pos IS NOT NULL) m
    SEMI JOIN read_pos USING (response, donor, donor_position)
),
candidates AS MATERIALIZED (
    SELECT * FROM (
        SELECT response, donor, hash FROM in_read
        UNION   -- stores written before n-grams had positions: anywhere in the prompt
        SELECT response, donor, hash FROM matched WHERE pos IS NULL
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
early AS (   -- per (hash, tenant): the two requests holding it that arrived first - enough to know whether
    SELECT hash, tenant_h,     -- one other than the response and its donor arrived before the response
           min_by({'i': incarnation, 't': arrived_at}, arrived_at, 2) AS first2
    FROM (SELECT DISTINCT hash, tenant_h, incarnation, arrived_at FROM hits)
    GROUP BY hash, tenant_h
),
tenant_own AS (  -- the response's tenant had the text in an earlier request of its own
    SELECT DISTINCT c.response, c.donor, c.hash
    FROM candidates c
    JOIN requests rr ON rr.incarnation = c.response
    JOIN early e ON e.hash = c.hash AND e.tenant_h = rr.tenant_h
    WHERE len(list_filter(e.first2, lambda x: x.t < rr.arrived_at AND x.i <> c.response AND x.i <> c.donor)) > 0
)
SELECT response, donor, count(*) AS shared_ngrams
FROM candidates
ANTI JOIN common USING (hash)
ANTI JOIN tenant_own USING (response, donor, hash)
GROUP BY ALL
