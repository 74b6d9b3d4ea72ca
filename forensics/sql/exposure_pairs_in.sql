-- Table macro over exposure_pairs and exposure_pairs_of (exposure_pairs_of.sql): one row per
-- (response incarnation, donor incarnation) with what the response read of the donor's KV in the
-- window [t0, t1].
-- exposure_pairs_in(t0, t1): for a window that holds the whole store (the readers' default, from
-- 1970 to 2262) the snapshot's exposure_pairs - the same rows over the whole store, kept and grown
-- with a live store (forensics/queries/grown.py) - else computed.
CREATE OR REPLACE MACRO exposure_pairs_in(t0, t1) AS TABLE
SELECT * FROM exposure_pairs WHERE t0 <= TIMESTAMP '1970-01-01' AND t1 >= TIMESTAMP '2262-01-01'
UNION ALL BY NAME
SELECT * FROM exposure_pairs_of(t0, t1, t0 <= TIMESTAMP '1970-01-01' AND t1 >= TIMESTAMP '2262-01-01');
