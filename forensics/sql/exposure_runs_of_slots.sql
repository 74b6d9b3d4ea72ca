-- exposure_runs over slot rows (the as-of join's exposure_slots, or a kept answers entry's): the
-- slot rows that differ only in their slot folded into one row with the slots as a mask - the
-- shape exposure_runs_index.sql reads from the exposure index, which exposure_pairs_of.sql reads.
SELECT s.node, s.boot, s.response, s.donor, s.page, s.generation, s.block_index,
       bit_or(1::UBIGINT << s.slot::UBIGINT) AS slot_mask, any_value(c.page_size) AS page_size,
       s.donor_position - s.slot AS position_offset, s.kind, s.write_generation, s.write_path, s.written_at,
       s.attention_mass, s.n_reads, s.step_first, s.step_last, s.lclock_first, s.ts_first, s.ts_last,
       s.trace_id, s.span_id
FROM exposure_slots s
LEFT JOIN (SELECT node, boot, any_value(page_size) AS page_size FROM config_snapshots GROUP BY node, boot) c
    ON c.node = s.node AND c.boot = s.boot
GROUP BY s.node, s.boot, s.response, s.donor, s.page, s.generation, s.block_index, s.donor_position - s.slot,
         s.kind, s.write_generation, s.write_path, s.written_at, s.attention_mass, s.n_reads, s.step_first,
         s.step_last, s.lclock_first, s.ts_first, s.ts_last, s.trace_id, s.span_id
