-- The n-gram evidence in steps (forensics/queries/evidence.py), step 1a: the donor positions each
-- pair read, as maximal runs of consecutive positions [lo, hi] - of the pairs of exposure_slots
-- whose response the read check did not stop, from their runs (exposure_runs): a run row's slots
-- read, its mask's set bits, are intervals of consecutive slots (from a set bit whose bit below is
-- clear to one whose bit above is), shifted by where the donor's write put the page's first slot;
-- a pair's intervals that overlap or touch are merged (an interval starts a run unless one before
-- it reaches it). The same runs as those of exposure_slots' donor positions (1.04 M positions into
-- 7.5 K runs at 121 M read rows), without a row per slot.
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
),
masks AS (
    SELECT DISTINCT response, donor, position_offset, slot_mask, page_size FROM exposure_runs ANTI JOIN blocked USING (response)
    WHERE donor <> -1 AND position_offset IS NOT NULL
),
intervals AS (
    SELECT DISTINCT response, donor,
           position_offset + unnest(list_filter(range(least(coalesce(page_size, 64), 64)), lambda s: (slot_mask >> s) & 1 = 1
                                                AND (s = 0 OR (slot_mask >> (s - 1)) & 1 = 0))) AS lo,
           position_offset + unnest(list_filter(range(least(coalesce(page_size, 64), 64)), lambda s: (slot_mask >> s) & 1 = 1
                                                AND (s = 63 OR (slot_mask >> (s + 1)) & 1 = 0))) AS hi
    FROM masks
),
starts AS (
    SELECT *, coalesce(lo > 1 + max(hi) OVER (PARTITION BY response, donor ORDER BY lo, hi
                                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), true) AS first
    FROM intervals
),
numbered AS (
    SELECT *, sum(first::INTEGER) OVER (PARTITION BY response, donor ORDER BY lo, hi ROWS UNBOUNDED PRECEDING) AS run
    FROM starts
)
SELECT response, donor, min(lo) AS lo, max(hi) AS hi FROM numbered GROUP BY response, donor, run
