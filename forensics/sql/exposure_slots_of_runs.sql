-- exposure_slots over exposure_runs (exposure_runs_index.sql): one row per set bit of a run's slot
-- mask (a page's slots, below its page size) - a slot's position in the response is its block's
-- index x the page size + the slot, in the donor the slot + where the donor's write put the page's
-- first slot.
SELECT node, boot, response, donor, page, generation, block_index, slot,
       block_index * page_size + slot AS position, slot + position_offset AS donor_position, kind,
       write_generation, write_path, written_at, attention_mass, n_reads, step_first, step_last,
       lclock_first, ts_first, ts_last, trace_id, span_id
FROM (SELECT *, unnest(list_filter(range(least(page_size, 64)), lambda s: (slot_mask >> s) & 1 = 1)) AS slot
      FROM exposure_runs)
