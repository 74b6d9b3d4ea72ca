-- The n-gram evidence in steps (forensics/queries/evidence.py), step 1b: a digest of what the
-- candidates read besides _ng - the (response, donor, donor position) rows of exposure_slots whose
-- response the read check did not stop (the pairs, and the positions each read). The same digest, no
-- new _ng rows, no new _hits rows and the same requests behind the kept rows: the answer is the kept one.
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
)
SELECT count(*) AS n, coalesce(bit_xor(hash(response, donor, donor_position)), 0) AS digest
FROM (SELECT DISTINCT response, donor, donor_position FROM exposure_slots ANTI JOIN blocked USING (response)
      WHERE donor <> -1)
