-- exposure_slots read from the exposure index the ledger writer keeps: see ../exposure_runs_index.sql and
-- ../exposure_slots_of_runs.sql
-- (the same rows as the as-of join of exposure_x.sql + exposure_slots.sql, without scanning the ledger).
WITH runs AS (
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch,
           max(slots_read) AS slots_read,
           sumIf(attention_mass, part = 0) AS attention_mass,
           toInt64(sumIf(n_reads, part = 0)) AS n_reads,
           min(step_first) AS step_first, max(step_last) AS step_last, min(lclock_first) AS lclock_first,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last, any(trace_id) AS trace_id, any(span_id) AS span_id
    FROM exposure_index
    GROUP BY node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch
),
found AS (
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch, donor,
           write_generation, write_path, written_at, position_offset,
           groupBitOr(slot_mask) AS slot_mask, max(donor_held) AS held
    FROM exposure_index
    GROUP BY node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch, donor,
             write_generation, write_path, written_at, position_offset
),
slots AS (
    SELECT * FROM (SELECT *, arrayJoin(range(64)) AS slot FROM found)
    WHERE bitAnd(bitShiftRight(slot_mask, slot), 1) = 1
),
ps AS (
    SELECT node, boot, any(page_size) AS page_size FROM config_snapshots GROUP BY node, boot
)
SELECT r.node AS node, r.boot AS boot, r.reader AS response, s.donor AS donor, r.page AS page,
       r.generation AS generation, r.block_index AS block_index, toInt64(s.slot) AS slot,
       toInt64(r.block_index * c.page_size + s.slot) AS position,
       toInt64(s.slot + s.position_offset) AS donor_position,
       CASE WHEN s.donor = -1 THEN 'unwritten'
            WHEN s.write_generation < r.generation THEN 'stale'
            WHEN s.held THEN 'co-holder'
            ELSE 'foreign' END AS kind,
       s.write_generation AS write_generation, s.write_path AS write_path, s.written_at AS written_at,
       r.attention_mass AS attention_mass, r.n_reads AS n_reads, r.step_first AS step_first, r.step_last AS step_last,
       r.lclock_first AS lclock_first, r.ts_first AS ts_first, r.ts_last AS ts_last, r.trace_id AS trace_id,
       r.span_id AS span_id
FROM runs AS r
INNER JOIN slots AS s
    ON s.node = r.node AND s.boot = r.boot AND s.reader = r.reader AND s.page = r.page AND s.generation = r.generation
   AND s.block_index = r.block_index AND s.found_generation = r.found_generation AND s.bad_mask = r.bad_mask
   AND s.epoch = r.epoch
INNER JOIN ps AS c ON c.node = r.node AND c.boot = r.boot
