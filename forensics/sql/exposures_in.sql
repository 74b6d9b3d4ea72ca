-- Table macro exposures_in(t0, t1): one row per (response incarnation, donor incarnation): what
-- the response read of the donor's KV - pages, foreign tokens (slots), attention mass on those
-- pages (summed over read steps), decode steps, first/last time, both sides' tenants (pseudonyms),
-- whether the two are one tenant (same_tenant: a cross-request, not a cross-tenant, exposure) and
-- the evidence level (README "Evidence levels"):
--   blocked   the read check stopped the response (ReadCheckViolation): it returned nothing, so
--             it is never an exposure (scores and tenant counts leave it out)
--   surfaced  the response's output holds an n-gram of the donor's prompt that is neither in its own
--             prompt nor common across the store (exposure_ngrams.sql)
--   read      it attended over the donor's slots
-- attention_mass: the softmax mass the response put on the donor's pages, summed over its read
-- steps (each step's mass averaged over layers): 1.0 = one step attending to nothing else, so 46.5
-- is about 46 steps' worth of attention on the donor's KV (NULL where a read was not measured).
-- response_finished: false for a response whose end is not in the store (still running, or cut
-- off; the readers name which: response_state); its evidence is judged on what it had streamed.
-- Window: a response is in [t0, t1] when any of its failing reads is: a read run overlapping the
-- window (first read at or before t1, last at or after t0) counts, whenever the response began.
CREATE OR REPLACE MACRO exposures_in(t0, t1) AS TABLE
WITH e AS (
    SELECT * FROM exposure_slots WHERE ts_first <= t1 AND ts_last >= t0
),
runs AS (   -- mass is per read run and page, not per slot: count each run once
    SELECT DISTINCT response, donor, node, boot, page, block_index, lclock_first, attention_mass FROM e
),
mass AS (
    SELECT response, donor, fsum(attention_mass) AS attention_mass FROM runs GROUP BY ALL
),
pair AS (   -- the slot rows folded to their pair first; the pair then meets its two requests (one row each)
    SELECT response, donor, any_value(boot) AS boot,
           list(DISTINCT kind ORDER BY kind) AS kinds,
           count(DISTINCT (node, boot, page)) AS pages,
           list_transform(list_sort(list(DISTINCT {'n': node, 'p': page})), lambda x: x.n || ':' || x.p::VARCHAR)
               AS node_pages,     -- node:page, by node then page number
           count(DISTINCT (node, boot, position)) AS foreign_tokens,
           min(step_first) AS first_step, max(step_last) AS last_step,
           min(ts_first) AS first_read, max(ts_last) AS last_read
    FROM e GROUP BY response, donor
)
SELECT p.response, r.tenant_h AS response_tenant, p.donor, d.tenant_h AS donor_tenant,
       coalesce(r.tenant_h = d.tenant_h, false) AS same_tenant,
       p.boot, p.kinds, p.pages, p.node_pages, p.foreign_tokens, m.attention_mass,
       CASE WHEN r.error_type = 'ReadCheckViolation' THEN 'blocked'
            WHEN s.shared_ngrams > 0 THEN 'surfaced' ELSE 'read' END AS evidence,
       coalesce(s.shared_ngrams, 0) AS shared_ngrams,
       coalesce(r.finished, false) AS response_finished,
       p.first_step, p.last_step, p.first_read, p.last_read
FROM pair p
JOIN mass m USING (response, donor)
LEFT JOIN exposure_ngrams s USING (response, donor)
LEFT JOIN requests r ON r.incarnation = p.response
LEFT JOIN requests d ON d.incarnation = p.donor
ORDER BY p.first_read, p.response, p.donor
