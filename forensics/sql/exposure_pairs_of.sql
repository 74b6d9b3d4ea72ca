-- Table macros over exposure_slots: one row per (response incarnation, donor incarnation) with
-- what the response read of the donor's KV in the window [t0, t1] - the part of exposures_in.sql
-- that folds slot rows (pages, foreign tokens, attention mass, steps, first/last read).
-- Window: a response is in [t0, t1] when any of its failing reads is: a read run overlapping the
-- window (first read at or before t1, last at or after t0) counts, whenever the response began.
-- exposure_pairs_of(t0, t1, skip): computed from the slot rows (none when skip); exposure_pairs_in.sql
-- reads the whole store's from a table kept with a live store.
CREATE OR REPLACE MACRO exposure_pairs_of(t0, t1, skip) AS TABLE
WITH e AS (
    SELECT * FROM exposure_slots WHERE ts_first <= t1 AND ts_last >= t0 AND NOT skip
),
runs AS (   -- mass is per read run and page, not per slot: count each run once
    SELECT DISTINCT response, donor, node, boot, page, block_index, lclock_first, attention_mass FROM e
),
mass AS (
    SELECT response, donor, fsum(attention_mass) AS attention_mass FROM runs GROUP BY ALL
),
pair AS (
    SELECT response, donor, any_value(boot) AS boot,
           list(DISTINCT kind ORDER BY kind) AS kinds,
           count(DISTINCT (node, boot, page)) AS pages,
           list_transform(list_sort(list(DISTINCT {'n': node, 'p': page})), lambda x: x.n || ':' || x.p::VARCHAR)
               AS node_pages,     -- node:page, by node then page number
           count(DISTINCT (node, boot, position)) AS foreign_tokens,
           min(step_first) AS first_step, max(step_last) AS last_step,
           min(ts_first) AS first_read, max(ts_last) AS last_read
    FROM e GROUP BY response, donor
)
SELECT p.*, m.attention_mass FROM pair p JOIN mass m USING (response, donor);
