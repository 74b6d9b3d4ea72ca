-- Every KV slot a response read whose content tag was not its own chain, attributed to its writer.
-- Failing reads are first merged into read runs: rows of one (node, reader, page, generation,
-- block column) that found the same thing (found generation, failing slots, the writer of every
-- slot in the tag plane) are one run, exactly as the ledger's own coalescing merges them (rows it
-- did not merge - a flush boundary, coalescing off - are merged here; n_reads, step and time
-- ranges and attention mass add up). A run expands to its failing slots (bad_mask bits); each is
-- joined AS OF the run's first logical clock to the last write of that (node, page, slot): the
-- donor. The same findings mean the same writer in every slot, so every read of the run has that
-- donor. Logical clocks, never wall clocks, order the join. Only pages some failing read touched
-- have their write runs expanded to slots. A slot the reader itself wrote (e.g. a placeholder)
-- discloses nothing to it and is left out.
--   kind: foreign   written in the page's current generation by another incarnation
--         stale     written in an earlier generation (the page was reallocated, bytes left behind)
--         unwritten no write recorded for that slot (donor -1)
WITH runs AS (
    SELECT node, reader, page, generation, block_index, bad_mask,
           max(slots_read) AS slots_read, sum(attention_mass) AS attention_mass, sum(n_reads) AS n_reads,
           min(step_first) AS step_first, max(step_last) AS step_last, min(lclock_first) AS lclock_first,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last, any_value(trace_id) AS trace_id,
           any_value(span_id) AS span_id
    FROM page_reads
    WHERE bad_mask <> 0
    GROUP BY node, reader, page, generation, block_index, found_generation, bad_mask, found_writers
),
bad AS (
    SELECT * FROM (SELECT *, unnest(range(slots_read::BIGINT)) AS slot FROM runs) WHERE (bad_mask >> slot) & 1 = 1
),
touched AS (   -- only pages some failing read touched: the as-of join's right side stays small
    SELECT DISTINCT node, page FROM runs
),
writes AS (
    SELECT node, page, slot_first + unnest(range(n_slots::BIGINT)) AS slot, lclock, writer,
           generation AS write_generation, path AS write_path, ts AS written_at
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
