-- Table macros over exposure_runs: one row per (response incarnation, donor incarnation) with
-- what the response read of the donor's KV in the window [t0, t1] - the part of exposures_in.sql
-- that folds slot rows (pages, foreign tokens, attention mass, steps, first/last read). It reads the
-- slot rows as runs (exposure_runs_index.sql from the index, exposure_runs_of_slots.sql over the
-- as-of join's): a run's slots share all but their slot, so every column but the tokens folds per
-- run, and a pair's distinct token positions (block index x page size + slot) are the set bits of
-- each of its blocks' runs' masks OR-ed together.
-- Window: a response is in [t0, t1] when any of its failing reads is: a read run overlapping the
-- window (first read at or before t1, last at or after t0) counts, whenever the response began.
-- exposure_pairs_of(t0, t1, skip): computed from the runs (none when skip); exposure_pairs_in.sql
-- reads the whole store's from a table kept with a live store.
CREATE OR REPLACE MACRO exposure_pairs_of(t0, t1, skip) AS TABLE
WITH e AS (
    SELECT * FROM exposure_runs WHERE ts_first <= t1 AND ts_last >= t0 AND NOT skip
),
runs AS (   -- mass is per read run and page, not per slot or write found: count each run once
    SELECT DISTINCT response, donor, node, boot, page, block_index, lclock_first, attention_mass FROM e
),
mass AS (
    SELECT response, donor, fsum(attention_mass) AS attention_mass FROM runs GROUP BY ALL
),
blocks AS ( -- the slots read of each block of the response's sequence
    SELECT response, donor, node, boot, block_index, bit_count(bit_or(slot_mask)) AS tokens FROM e GROUP BY ALL
),
tokens AS (
    SELECT response, donor, sum(tokens)::BIGINT AS foreign_tokens FROM blocks GROUP BY ALL
),
pair AS (
    SELECT response, donor, any_value(boot) AS boot,
           list(DISTINCT kind ORDER BY kind) AS kinds,
           count(DISTINCT (node, boot, page)) AS pages,
           list_transform(list_sort(list(DISTINCT {'n': node, 'p': page})), lambda x: x.n || ':' || x.p::VARCHAR)
               AS node_pages,     -- node:page, by node then page number
           min(step_first) AS first_step, max(step_last) AS last_step,
           min(ts_first) AS first_read, max(ts_last) AS last_read
    FROM e GROUP BY response, donor
)
SELECT p.response, p.donor, p.boot, p.kinds, p.pages, p.node_pages, t.foreign_tokens, p.first_step, p.last_step,
       p.first_read, p.last_read, m.attention_mass
FROM pair p JOIN tokens t USING (response, donor) JOIN mass m USING (response, donor);
