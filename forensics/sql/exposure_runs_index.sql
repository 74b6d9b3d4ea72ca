-- exposure_runs, read from the exposure index the ledger writer keeps (telemetry/exposure_index.py):
-- one row per read run and write found in its failing slots, the slots as a mask. Its slot rows
-- (exposure_slots_of_runs.sql: one per set bit) are the rows of the slot-level as-of join
-- (exposure_slots.sql, the ground truth), without scanning the ledger; readers keep the runs (8
-- times fewer rows than slots at 121 M read rows) and read the slots through a view over them.
-- The index's rows are (group of failing reads in one fold, write found in their failing slots);
-- grouping them by the join's run key - (node, boot, reader, page, generation, block column, found
-- generation, failing slots) and the epoch, the last write to a failing slot before the reads (the
-- join's cuts) - gives the join's runs: reads, steps, clocks, times and attention mass add up over
-- the folds (part 0 carries a group's aggregates once). A donor is co-holder when any fold had
-- recorded its own read of the page in the generation it wrote.
-- Readers use it when every run of the store that has a page ledger wrote the index beside it;
-- `kvledger forensics verify-index` holds its slots and the join's to the same rows.
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
)
SELECT j.node, j.boot, j.reader AS response, j.donor, j.page, j.generation, j.block_index, j.slot_mask,
       c.page_size, j.position_offset,
       CASE WHEN j.donor = -1 THEN 'unwritten'
            WHEN j.write_generation < j.generation THEN 'stale'
            WHEN j.held THEN 'co-holder'
            ELSE 'foreign' END AS kind,
       j.write_generation, j.write_path, j.written_at, j.attention_mass, j.n_reads, j.step_first, j.step_last,
       j.lclock_first, j.ts_first, j.ts_last, j.trace_id, j.span_id
FROM joined j
JOIN (SELECT node, boot, any_value(page_size) AS page_size FROM config_snapshots GROUP BY node, boot) c
    ON c.node = j.node AND c.boot = j.boot
WHERE j.slot_mask <> 0
