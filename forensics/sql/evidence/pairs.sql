-- The n-gram evidence (exposure_ngrams.sql, the rule) built in steps over cached rows
-- (forensics/queries/evidence.py), step 1: the incarnations whose n-grams it reads - both sides of
-- every (response, donor) pair of exposure_slots (read as its runs: exposure_runs) whose response
-- the read check did not stop.
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
),
pairs AS (
    SELECT DISTINCT response, donor FROM exposure_runs ANTI JOIN blocked USING (response) WHERE donor <> -1
)
SELECT response AS incarnation FROM pairs UNION SELECT donor FROM pairs
