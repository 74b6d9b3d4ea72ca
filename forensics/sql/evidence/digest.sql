-- The n-gram evidence in steps (forensics/queries/evidence.py), step 1b: a digest of what the
-- candidates read besides _ng - the pairs of exposure_slots (from its runs, exposure_runs) whose
-- response the read check did not stop, and the runs of donor positions each read (_read_runs, step
-- 1a: maximal runs, so one set of positions has one set of runs). The same digest, no new _ng rows,
-- no new _hits rows and the same requests behind the kept rows: the answer is the kept one.
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
)
SELECT count(*) AS n, coalesce(bit_xor(h), 0) AS digest
FROM (SELECT hash(response, donor, lo, hi) AS h FROM _read_runs
      UNION ALL
      SELECT hash(response, donor) FROM (SELECT DISTINCT response, donor FROM exposure_runs ANTI JOIN blocked USING (response)
                                         WHERE donor <> -1))
