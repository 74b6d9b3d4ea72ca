-- Every KV slot a response read whose content tag was not its own chain, attributed to its writer,
-- with its kind (stale, co-holder, foreign, unwritten): see ../exposure_slots.sql. The failing
-- slots and their donors come from exposure_x.
WITH need AS (      -- (page, generation, donor) whose holding decides co-holder vs foreign
    SELECT DISTINCT node, boot, page, wg AS generation, donor AS reader
    FROM (SELECT node, boot, page, write_generation AS wg, donor FROM exposure_x
          WHERE donor != -1 AND write_generation >= generation)
),
holders AS (
    SELECT DISTINCT node, boot, page, generation, reader AS holder
    FROM page_reads
    WHERE (node, boot, page, generation, reader) IN (SELECT node, boot, page, generation, reader FROM need)
)
SELECT x.node AS node, x.boot AS boot, x.response AS response, x.donor AS donor, x.page AS page,
       x.generation AS generation, x.block_index AS block_index, x.slot AS slot, x.position AS position,
       x.donor_position AS donor_position,
       CASE WHEN x.donor = -1 THEN 'unwritten'
            WHEN x.write_generation < x.generation THEN 'stale'
            WHEN h.holder IS NOT NULL THEN 'co-holder'
            ELSE 'foreign' END AS kind,
       x.write_generation AS write_generation, x.write_path AS write_path, x.written_at AS written_at,
       x.attention_mass AS attention_mass, x.n_reads AS n_reads, x.step_first AS step_first, x.step_last AS step_last,
       x.lclock_first AS lclock_first, x.ts_first AS ts_first, x.ts_last AS ts_last, x.trace_id AS trace_id,
       x.span_id AS span_id
FROM exposure_x AS x
LEFT JOIN holders AS h
    ON h.node = x.node AND h.boot = x.boot AND h.page = x.page AND h.generation = x.write_generation AND h.holder = x.donor
