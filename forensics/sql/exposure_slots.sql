-- Every KV slot a response read whose content tag was not its own chain, attributed to its writer.
-- Failing reads (bad_mask <> 0) are first merged into read runs, then each run's failing slots are
-- joined AS OF the run's first logical clock to the last write of that (node, page, slot): the
-- donor. Logical clocks, never wall clocks, order the join; node names and clocks restart with
-- every run, so every join keys on (node, boot).
-- A run: the reads of one (node, reader, page, generation, block column) that found the same
-- generation and failing slots, with no write to any of those failing slots between them (a write
-- that does "cuts" the run there). Every read of a run therefore has exactly the donors its first
-- read has - the same answer as joining every read row on its own - whether the ledger coalesced
-- them (the default) or not (one row per read step); n_reads, step and time ranges and attention
-- mass add up. Only pages some failing read touched have their write runs expanded to slots, and
-- found_writers (a list per row) is never read: at 100 M rows, reading it would be most of the cost.
-- A slot the reader itself wrote (e.g. a placeholder) discloses nothing to it and is left out.
-- position: the slot's place in the reader's sequence; donor_position: the place in the donor's own
-- sequence whose KV the slot held (NULL: unwritten) - what exposure_ngrams matches text against.
--   kind: stale     written in an earlier generation than the one the reader was granted (the page
--                   was reallocated and the bytes were left behind)
--         co-holder written in the reader's generation or a later one by a request that held the
--                   page itself in the generation it wrote (a page handed to two requests at once:
--                   a double free); the donor's own reads of that page in that generation show it
--         foreign   written in the reader's generation or a later one by a request that did not
--                   hold the page (a late write: a transfer landing after its request let go)
--         unwritten no write recorded for that slot (donor -1)
-- Plan notes (DuckDB 2.0, 121 M read rows, 2 cores: 5.4 -> 2.1 s): f is read twice but not
-- materialised (split reads it again only for the groups a write cut, none in most stores); every
-- group's aggregates come from the one pass that groups it (g), so an uncut group is one run without
-- a second GROUP BY over the failing reads; touched is one aggregate row unnested, which DuckDB
-- estimates as small - as a GROUP BY or DISTINCT it was estimated at the failing reads' count and the
-- hash table was built on page_writes (28.8 M rows, 4.3 s) instead of on the touched pages.
WITH f AS NOT MATERIALIZED (
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, slots_read, attention_mass,
           n_reads, step_first, step_last, lclock_first, ts_first, ts_last, trace_id, span_id
    FROM page_reads
    WHERE bad_mask <> 0
),
g AS (      -- identical findings; their reads may still straddle a write to a failing slot (cut below)
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask,
           min(lclock_first) AS lo, max(lclock_first) AS hi,
           max(slots_read) AS slots_read, fsum(attention_mass) AS attention_mass, sum(n_reads)::BIGINT AS n_reads,
           min(step_first) AS step_first, max(step_last) AS step_last, min(lclock_first) AS lclock_first,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last, any_value(trace_id) AS trace_id,
           any_value(span_id) AS span_id        -- (a reader's ids: the same on all its rows)
    FROM f GROUP BY node, boot, reader, page, generation, block_index, found_generation, bad_mask
),
touched AS (   -- only pages some failing read touched: the write side stays small
    SELECT unnest(list(DISTINCT {'node': node, 'boot': boot, 'page': page}), recursive := true) FROM g
),
wr AS (
    SELECT node, boot, page, slot_first, n_slots, position_first, lclock, writer, generation AS write_generation,
           path AS write_path, ts AS written_at
    FROM page_writes SEMI JOIN touched USING (node, boot, page)
    WHERE path <> 'offload'
),
cuts AS (      -- a write that changed one of a group's failing slots between its first and last read
    SELECT DISTINCT g.node, g.boot, g.reader, g.page, g.generation, g.block_index, g.found_generation, g.bad_mask,
           w.lclock AS cut
    FROM g JOIN wr w ON w.node = g.node AND w.boot = g.boot AND w.page = g.page AND w.lclock > g.lo AND w.lclock <= g.hi
    WHERE ((g.bad_mask::HUGEINT >> w.slot_first) & ((1::HUGEINT << w.n_slots) - 1)) <> 0
),
split AS (     -- reads of a cut group: the run they belong to is the last cut at or before them
    SELECT f.*, c.cut AS epoch
    FROM (SELECT * FROM f SEMI JOIN cuts USING (node, boot, reader, page, generation, block_index, found_generation, bad_mask)) f
    ASOF LEFT JOIN cuts c
        ON f.node = c.node AND f.boot = c.boot AND f.reader = c.reader AND f.page = c.page AND f.generation = c.generation
       AND f.block_index = c.block_index AND f.found_generation = c.found_generation AND f.bad_mask = c.bad_mask
       AND f.lclock_first >= c.cut
),
runs AS (     -- the cut groups' runs from their reads; every other group is one run (g)
    SELECT node, boot, reader, page, generation, block_index, bad_mask,
           max(slots_read) AS slots_read, fsum(attention_mass) AS attention_mass, sum(n_reads)::BIGINT AS n_reads,
           min(step_first) AS step_first, max(step_last) AS step_last, min(lclock_first) AS lclock_first,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last, any_value(trace_id) AS trace_id,
           any_value(span_id) AS span_id
    FROM split
    GROUP BY node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch
    UNION ALL BY NAME
    SELECT node, boot, reader, page, generation, block_index, bad_mask, slots_read, attention_mass, n_reads,
           step_first, step_last, lclock_first, ts_first, ts_last, trace_id, span_id
    FROM g ANTI JOIN cuts USING (node, boot, reader, page, generation, block_index, found_generation, bad_mask)
),
bad AS (
    SELECT * FROM (SELECT *, unnest(range(slots_read::BIGINT)) AS slot FROM runs) WHERE (bad_mask >> slot) & 1 = 1
),
writes AS (    -- each written slot, and the position in its writer's sequence whose KV it holds
    SELECT node, boot, page, slot_first + i AS slot, position_first + i AS donor_position, lclock, writer,
           write_generation, write_path, written_at
    FROM (SELECT *, unnest(range(n_slots::BIGINT)) AS i FROM wr)
),
x AS MATERIALIZED (   -- each failing slot and its donor, the last write before the read
    SELECT b.node, b.boot, b.reader AS response, coalesce(w.writer, -1) AS donor, b.page, b.generation,
           b.block_index, b.slot, b.block_index * c.page_size + b.slot AS position, w.donor_position,
           w.write_generation, w.write_path, w.written_at, b.attention_mass, b.n_reads, b.step_first, b.step_last,
           b.lclock_first, b.ts_first, b.ts_last, b.trace_id, b.span_id
    FROM bad b
    JOIN (SELECT node, boot, any_value(page_size) AS page_size FROM config_snapshots GROUP BY node, boot) c
        ON c.node = b.node AND c.boot = b.boot
    ASOF LEFT JOIN writes w
        ON b.node = w.node AND b.boot = w.boot AND b.page = w.page AND b.slot = w.slot AND b.lclock_first >= w.lclock
    WHERE w.writer IS DISTINCT FROM b.reader
),
need AS (      -- (page, generation, donor) whose holding decides co-holder vs foreign
    SELECT DISTINCT node, boot, page, write_generation AS generation, donor AS reader
    FROM x WHERE donor <> -1 AND write_generation >= generation
),
holders AS (   -- of those, the ones the donor was granted: its own reads of that page in that generation
    SELECT DISTINCT node, boot, page, generation, reader AS holder
    FROM page_reads SEMI JOIN need USING (node, boot, page, generation, reader)
)
SELECT x.node, x.boot, x.response, x.donor, x.page, x.generation, x.block_index, x.slot, x.position, x.donor_position,
       CASE WHEN x.donor = -1 THEN 'unwritten'
            WHEN x.write_generation < x.generation THEN 'stale'
            WHEN h.holder IS NOT NULL THEN 'co-holder'
            ELSE 'foreign' END AS kind,
       x.write_generation, x.write_path, x.written_at, x.attention_mass, x.n_reads, x.step_first, x.step_last,
       x.lclock_first, x.ts_first, x.ts_last, x.trace_id, x.span_id
FROM x
LEFT JOIN holders h
    ON h.node = x.node AND h.boot = x.boot AND h.page = x.page AND h.generation = x.write_generation AND h.holder = x.donor
