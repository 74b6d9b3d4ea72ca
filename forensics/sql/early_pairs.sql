-- The pairs a dashboard's banner can name before the n-gram evidence is built: one row per
-- (response, donor) pair of the window [$from, $to] - the pairs of exposures.sql, with both sides'
-- tenants, whether the read check stopped the response, the nodes of its pages and its first and
-- last read - read from the exposure index's runs without expanding them to slot rows and without
-- the evidence (which only says whether a pair is 'surfaced' or 'read'). Runs and windows as
-- exposure_runs_index.sql and exposure_pairs_of.sql: a run's reads span min(ts_first) to
-- max(ts_last) over its index rows, and a pair is in the window when any of its runs is; a donor
-- counts where one of its writes was found in a failing slot (slot_mask: the reader's own left out).
-- Held to exposures.sql's pairs, tenants and times by tests/test_dashboard.py.
WITH runs AS (
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last
    FROM exposure_index
    GROUP BY ALL
),
found AS (
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch, donor
    FROM exposure_index
    GROUP BY ALL
    HAVING bit_or(slot_mask) <> 0
),
pair AS (
    SELECT f.reader AS response, f.donor, list(DISTINCT f.node ORDER BY f.node) AS nodes,
           min(r.ts_first) AS first_read, max(r.ts_last) AS last_read
    FROM runs r
    JOIN found f USING (node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch)
    WHERE r.ts_first <= $to AND r.ts_last >= $from
    GROUP BY ALL
)
SELECT p.response, r.tenant_h AS response_tenant, p.donor, d.tenant_h AS donor_tenant,
       coalesce(r.tenant_h = d.tenant_h, false) AS same_tenant,
       coalesce(r.error_type = 'ReadCheckViolation', false) AS blocked, p.nodes, p.first_read, p.last_read
FROM pair p
LEFT JOIN requests r ON r.incarnation = p.response
LEFT JOIN requests d ON d.incarnation = p.donor
ORDER BY p.first_read, p.response, p.donor
