-- The first half of ../exposure_slots.sql (read it for the why): every failing slot of every read
-- run, joined AS OF the run's first logical clock to the last write of that (node, boot, page,
-- slot). Materialised on its own: exposure_slots reads it twice. The groups of failing reads come
-- materialised with their aggregates (exposure_g.sql); only the reads of groups a write cut are read
-- again (f), joined AS OF to their group's cuts and summed per run; every other group is one run.
-- (121 M read rows on chdb: 4.2 -> 2.8-3.0 s with exposure_g; every failing read had been joined
-- AS OF to the cuts and grouped again, and the groups computed at each of their three uses.)
WITH g AS (SELECT * FROM exposure_g),
wr AS (
    SELECT node, boot, page, slot_first, n_slots, position_first, lclock, writer, generation AS write_generation,
           path AS write_path, ts AS written_at
    FROM page_writes
    WHERE path != 'offload' AND (node, boot, page) IN (SELECT node, boot, page FROM g)
),
cuts AS (      -- a write that changed one of a group's failing slots between its first and last read
    SELECT DISTINCT g.node AS node, g.boot AS boot, g.reader AS reader, g.page AS page, g.generation AS generation,
           g.block_index AS block_index, g.found_generation AS found_generation, g.bad_mask AS bad_mask, w.lclock AS cut
    FROM g JOIN wr AS w ON w.node = g.node AND w.boot = g.boot AND w.page = g.page
    WHERE w.lclock > g.lo AND w.lclock <= g.hi
      AND bitAnd(bitShiftRight(reinterpretAsUInt64(g.bad_mask), w.slot_first),
                 if(w.n_slots >= 64, toUInt64(18446744073709551615), bitShiftLeft(toUInt64(1), w.n_slots) - 1)) != 0
),
f AS (         -- the reads of the groups a write cut
    SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask, slots_read, attention_mass,
           n_reads, step_first, step_last, lclock_first, ts_first, ts_last, trace_id, span_id
    FROM page_reads
    WHERE bad_mask != 0
      AND (node, boot, reader, page, generation, block_index, found_generation, bad_mask)
          IN (SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask FROM cuts)
),
split AS (     -- each of those reads and the last cut of its group at or before it (NULL: none)
    SELECT f.node AS node, f.boot AS boot, f.reader AS reader, f.page AS page, f.generation AS generation,
           f.block_index AS block_index, f.found_generation AS found_generation, f.bad_mask AS bad_mask,
           f.slots_read AS slots_read, f.attention_mass AS attention_mass, f.n_reads AS n_reads,
           f.step_first AS step_first, f.step_last AS step_last, f.lclock_first AS lclock_first,
           f.ts_first AS ts_first, f.ts_last AS ts_last, f.trace_id AS trace_id, f.span_id AS span_id, c.cut AS epoch
    FROM f
    ASOF LEFT JOIN cuts AS c
        ON f.node = c.node AND f.boot = c.boot AND f.reader = c.reader AND f.page = c.page AND f.generation = c.generation
       AND f.block_index = c.block_index AND f.found_generation = c.found_generation AND f.bad_mask = c.bad_mask
       AND f.lclock_first >= c.cut
),
runs AS (      -- a run: the reads of one group between two cuts; a group with no cut is one run
    SELECT node, boot, reader, page, generation, block_index, bad_mask,
           max(slots_read) AS slots_read, sumKahan(attention_mass) AS attention_mass, sum(n_reads) AS n_reads,
           min(step_first) AS step_first, max(step_last) AS step_last, min(lclock_first) AS lclock_first,
           min(ts_first) AS ts_first, max(ts_last) AS ts_last, min(trace_id) AS trace_id, min(span_id) AS span_id
    FROM split
    GROUP BY node, boot, reader, page, generation, block_index, found_generation, bad_mask, epoch
    UNION ALL
    SELECT node, boot, reader, page, generation, block_index, bad_mask, slots_read, attention_mass, n_reads,
           step_first, step_last, lo AS lclock_first, ts_first, ts_last, trace_id, span_id
    FROM g
    WHERE (node, boot, reader, page, generation, block_index, found_generation, bad_mask)
          NOT IN (SELECT node, boot, reader, page, generation, block_index, found_generation, bad_mask FROM cuts)
),
bad AS (
    SELECT * FROM (SELECT *, toInt64(arrayJoin(range(toUInt64(slots_read)))) AS slot FROM runs)
    WHERE bitTest(bad_mask, slot)
),
writes AS (
    SELECT node, boot, page, toInt64(slot_first) + i AS slot, toInt64(position_first) + i AS donor_position, lclock,
           writer, write_generation, write_path, written_at
    FROM wr ARRAY JOIN arrayMap(x -> toInt64(x), range(toUInt64(n_slots))) AS i
)
SELECT b.node AS node, b.boot AS boot, b.reader AS response, coalesce(w.writer, -1) AS donor, b.page AS page,
       b.generation AS generation, b.block_index AS block_index, b.slot AS slot,
       b.block_index * c.page_size + b.slot AS position, w.donor_position AS donor_position,
       w.write_generation AS write_generation, w.write_path AS write_path, w.written_at AS written_at,
       b.attention_mass AS attention_mass, b.n_reads AS n_reads, b.step_first AS step_first, b.step_last AS step_last,
       b.lclock_first AS lclock_first, b.ts_first AS ts_first, b.ts_last AS ts_last, b.trace_id AS trace_id,
       b.span_id AS span_id
FROM bad AS b
JOIN (SELECT node, boot, any(page_size) AS page_size FROM config_snapshots GROUP BY node, boot) AS c
    ON c.node = b.node AND c.boot = b.boot
ASOF LEFT JOIN writes AS w
    ON b.node = w.node AND b.boot = w.boot AND b.page = w.page AND b.slot = w.slot AND b.lclock_first >= w.lclock
WHERE w.writer IS NULL OR w.writer != b.reader
