-- The n-gram evidence in steps (forensics/queries/evidence.py), step 1a: the masks of the donor
-- positions each pair read - of the pairs of exposure_slots whose response the read check did not
-- stop, from their runs (exposure_runs): a run row's slots read are its mask's set bits, shifted by
-- where the donor's write put the page's first slot. evidence.read_runs folds them into maximal runs
-- of consecutive positions [lo, hi] per pair (1.04 M positions into 7.5 K runs at 121 M read rows):
-- the same runs as those of exposure_slots' donor positions, without a row per slot.
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
)
SELECT DISTINCT response, donor, position_offset, slot_mask, least(coalesce(page_size, 64), 64) AS width
FROM exposure_runs ANTI JOIN blocked USING (response)
WHERE donor <> -1 AND position_offset IS NOT NULL AND slot_mask IS NOT NULL AND response IS NOT NULL
