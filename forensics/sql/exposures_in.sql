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
-- Window: as exposure_pairs_in.sql (the slot rows' part of this answer).
CREATE OR REPLACE MACRO exposures_in(t0, t1) AS TABLE
SELECT p.response, r.tenant_h AS response_tenant, p.donor, d.tenant_h AS donor_tenant,
       coalesce(r.tenant_h = d.tenant_h, false) AS same_tenant,
       p.boot, p.kinds, p.pages, p.node_pages, p.foreign_tokens, p.attention_mass,
       CASE WHEN r.error_type = 'ReadCheckViolation' THEN 'blocked'
            WHEN s.shared_ngrams > 0 THEN 'surfaced' ELSE 'read' END AS evidence,
       coalesce(s.shared_ngrams, 0) AS shared_ngrams,
       coalesce(r.finished, false) AS response_finished,
       p.first_step, p.last_step, p.first_read, p.last_read
FROM exposure_pairs_in(t0, t1) p     -- the slot rows folded to their pair first; the pair then meets its two requests
LEFT JOIN exposure_ngrams s USING (response, donor)
LEFT JOIN requests r ON r.incarnation = p.response
LEFT JOIN requests d ON d.incarnation = p.donor
ORDER BY p.first_read, p.response, p.donor
