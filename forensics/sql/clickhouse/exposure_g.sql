-- The failing reads of ../exposure_slots.sql grouped by identical findings (its g), each group with
-- the aggregates of all its reads: a group no write cut (most, in every store seen so far) is one
-- read run as it stands. Materialised on its own (exposure_x reads it three times: ClickHouse runs a
-- WITH clause's subquery again at every use, and each run of this one scans the failing reads).
SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask,
       min(lclock_first) AS lo, max(lclock_first) AS hi,
       max(slots_read) AS slots_read, sumKahan(attention_mass) AS attention_mass, sum(n_reads) AS n_reads,
       min(step_first) AS step_first, max(step_last) AS step_last,
       min(ts_first) AS ts_first, max(ts_last) AS ts_last, min(trace_id) AS trace_id, min(span_id) AS span_id
FROM page_reads
WHERE bad_mask != 0
GROUP BY node, boot, reader, page, generation, block_index, found_generation, bad_mask
