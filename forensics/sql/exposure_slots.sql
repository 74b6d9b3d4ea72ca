-- Every KV slot a response read whose content tag was not its own chain, attributed to its writer.
-- Failing reads (bad_mask <> 0) are first merged into read runs, then each run's failing slots are
-- joined AS OF the run's first logical clock to the last write of that (node, page, slot): the
-- donor. Logical clocks, never wall clocks, order the join.
-- A run: the reads of one (node, reader, page, generation, block column) that found the same
-- generation and failing slots, with no write to any of those failing slots between them (a write
-- that does "cuts" the run there). Every read of a run therefore has exactly the donors its first
-- read has - the same answer as joining every read row on its own - whether the ledger coalesced
-- them (the default) or not (one row per read step); n_reads, step and time ranges and attention
-- mass add up. Only pages some failing read touched have their write runs expanded to slots, and
-- found_writers (a list per row) is never read: at 100 M rows, reading it would be most of the cost.
-- A slot the reader itself wrote (e.g. a placeholder) discloses nothing to it and is left out.
--   kind: foreign   written in the page's current generation by another incarnation
--         stale     written in an earlier generation (the page was reallocated, bytes left behind)
--         unwritten no write recorded for that slot (donor -1)
WITH f AS (
    SELECT node, reader, page, generation, block_index, found_generation, bad_mask, slots_read, attention_mass,
           n_reads, step_first, step_last, lclock_first, ts_first, ts_last, trace_id, span_id
    FROM page_reads
    WHERE bad_mask <> 0
),
g AS (      -- identical findings; their reads may still straddle a write to a failing slot (cut below)
    SELECT node, reader, page, generation, block_index, found_generation, bad_mask,
           min(lclock_first) AS lo, max(lclock_first) AS hi
    FROM f GROUP BY ALL
),
touched AS (   -- only pages some failing read touched: the write side stays small
    SELECT DISTINCT node, page FROM g
),
wr AS (
    SELECT node, page, slot_first, n_slots, lclock, writer, generation AS write_generation, path AS write_path,
           ts AS written_at
    FROM page_writes SEMI JOIN touched USING (node, page)
    WHERE path <> 'offload'
),
cuts AS (      -- a write that changed one of a group's failing slots between its first and last read
    SELECT DISTINCT g.node, g.reader, g.page, g.generation, g.block_index, g.found_generation, g.bad_mask,
           w.lclock AS cut
    FROM g JOIN wr w ON w.node = g.node AND w.page = g.page AND w.lclock > g.lo AND w.lclock <= g.hi
    WHERE ((g.bad_mask::HUGEINT >> w.slot_first) & ((1::HUGEINT << w.n_slots) - 1)) <> 0
),
split AS (     -- reads of a cut group: the run they belong to is the last cut at or before them
    SELECT f.*, c.cut AS epoch
    FROM (SELECT * FROM f SEMI JOIN cuts USING (node, reader, page, generation, block_index, found_generation, bad_mask)) f
    ASOF LEFT JOIN cuts c
        ON f.node = c.node AND f.reader = c.reader AND f.page = c.page AND f.generation = c.generation
       AND f.block_index = c.block_index AND f.found_generation = c.found_generation AND f.bad_mask = c.bad_mask
       AND f.lclock_first >= c.cut
),
runs AS (
    SELECT node, reader, page, generation, block_index, bad_mask,
           max(slots_read) AS slots_read, sum(attention_mass) AS attention_mass, sum(n_reads) AS n_reads,
           min(step_first) AS step_first, max(step_last) AS step_last, min(lclock_first) AS lclock_first,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last, any_value(trace_id) AS trace_id,
           any_value(span_id) AS span_id
    FROM (SELECT *, NULL::BIGINT AS epoch FROM f ANTI JOIN cuts USING (node, reader, page, generation, block_index, found_generation, bad_mask)
          UNION ALL BY NAME SELECT * FROM split)
    GROUP BY node, reader, page, generation, block_index, found_generation, bad_mask, epoch
),
bad AS (
    SELECT * FROM (SELECT *, unnest(range(slots_read::BIGINT)) AS slot FROM runs) WHERE (bad_mask >> slot) & 1 = 1
),
writes AS (
    SELECT node, page, slot_first + unnest(range(n_slots::BIGINT)) AS slot, lclock, writer, write_generation,
           write_path, written_at
    FROM wr
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
