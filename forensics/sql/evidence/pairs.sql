-- The n-gram evidence (exposure_ngrams.sql, the rule) built in steps over cached rows
-- (forensics/queries/evidence.py), step 1: the incarnations whose output n-grams it reads - the
-- response of every (response, donor) pair of exposure_slots (read as its runs: exposure_runs) the
-- read check did not stop (the prompts' rows it reads are those holding one of their hashes).
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
),
pairs AS (
    SELECT DISTINCT response, donor FROM exposure_runs ANTI JOIN blocked USING (response) WHERE donor <> -1
)
SELECT DISTINCT response AS incarnation FROM pairs
