-- exposure_slots, read from the exposure index the ledger writer keeps (telemetry/exposure_index.py):
-- the same rows as the slot-level as-of join (exposure_slots.sql, the ground truth), without
-- scanning the ledger. The index's rows are (group of failing reads in one fold, write found in
-- their failing slots); grouping them by the join's run key - (node, boot, reader, page,
-- generation, block column, found generation, failing slots) and the epoch, the last write to a
-- failing slot before the reads (the join's cuts) - gives the join's runs: reads, steps, clocks,
-- times and attention mass add up over the folds (part 0 carries a group's aggregates once).
-- A donor is co-holder when any fold had recorded its own read of the page in the generation it wrote.
-- Readers use it when every run of the store that has a page ledger wrote the index beside it;
-- `kvledger forensics verify-index` holds the two to the same rows.
WITH runs AS (
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch,
           max(slots_read) AS slots_read,
           fsum(attention_mass) FILTER (WHERE part = 0) AS attention_mass,
           sum(n_reads) FILTER (WHERE part = 0)::BIGINT AS n_reads,
           min(step_first) AS step_first, max(step_last) AS step_last, min(lclock_first) AS lclock_first,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last, any_value(trace_id) AS trace_id,
           any_value(span_id) AS span_id
    FROM exposure_index
    GROUP BY node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch
),
found AS (      -- each write found in a run's failing slots, and where
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch, donor,
           write_generation, write_path, written_at, position_offset,
           bit_or(slot_mask) AS slot_mask, bool_or(donor_held) AS held
    FROM exposure_index
    GROUP BY ALL
),
joined AS (     -- each write found with its run (before the mask's bits become rows: a few times fewer to join)
    SELECT r.*, s.donor, s.write_generation, s.write_path, s.written_at, s.position_offset, s.slot_mask, s.held
    FROM runs r
    JOIN found s USING (node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch)
),
slots AS (     -- one row per set bit of the mask
    SELECT *, unnest(list_filter(range(64), lambda s: (slot_mask >> s) & 1 = 1)) AS slot FROM joined
)
SELECT s.node, s.boot, s.reader AS response, s.donor, s.page, s.generation, s.block_index, s.slot,
       s.block_index * c.page_size + s.slot AS position, s.slot + s.position_offset AS donor_position,
       CASE WHEN s.donor = -1 THEN 'unwritten'
            WHEN s.write_generation < s.generation THEN 'stale'
            WHEN s.held THEN 'co-holder'
            ELSE 'foreign' END AS kind,
       s.write_generation, s.write_path, s.written_at, s.attention_mass, s.n_reads, s.step_first, s.step_last,
       s.lclock_first, s.ts_first, s.ts_last, s.trace_id, s.span_id
FROM slots s
JOIN (SELECT node, boot, any_value(page_size) AS page_size FROM config_snapshots GROUP BY node, boot) c
    ON c.node = s.node AND c.boot = s.boot
