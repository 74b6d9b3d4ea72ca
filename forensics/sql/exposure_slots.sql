-- Every KV slot a response read whose content tag was not its own chain, attributed to its writer.
-- A read run of page_reads expands to its failing slots (bad_mask bits); each is joined AS OF the
-- read's logical clock to the last write of that (node, page, slot): the donor. Logical clocks,
-- never wall clocks, order the join. A slot the reader itself wrote (e.g. a placeholder) discloses
-- nothing to it and is left out.
--   kind: foreign   written in the page's current generation by another incarnation
--         stale     written in an earlier generation (the page was reallocated, bytes left behind)
--         unwritten no write recorded for that slot (donor -1)
WITH slots AS (
    SELECT *, unnest(range(slots_read::BIGINT)) AS slot
    FROM page_reads
    WHERE bad_mask <> 0
),
bad AS (
    SELECT * FROM slots WHERE (bad_mask >> slot) & 1 = 1
),
touched AS (   -- only pages some failing read touched: the as-of join's right side stays small
    SELECT DISTINCT node, page FROM bad
),
writes AS (
    SELECT node, page, slot::BIGINT AS slot, lclock, writer, generation AS write_generation, path AS write_path,
           ts AS written_at
    FROM page_writes SEMI JOIN touched USING (node, page)
    WHERE path <> 'offload'
)
SELECT b.node, b.reader AS response, coalesce(w.writer, -1) AS donor, b.page, b.generation,
       b.block_index, b.slot, b.block_index * c.page_size + b.slot AS position,
       CASE WHEN w.writer IS NULL THEN 'unwritten'
            WHEN w.write_generation <> b.generation THEN 'stale'
            ELSE 'foreign' END AS kind,
       w.write_path, w.written_at, b.attention_mass, b.n_reads, b.step_first, b.step_last,
       b.lclock_first, b.ts_first, b.ts_last, b.trace_id, b.span_id
FROM bad b
JOIN (SELECT node, any_value(page_size) AS page_size FROM config_snapshots GROUP BY node) c ON c.node = b.node
ASOF LEFT JOIN writes w
    ON b.node = w.node AND b.page = w.page AND b.slot = w.slot AND b.lclock_first >= w.lclock
WHERE w.writer IS DISTINCT FROM b.reader
