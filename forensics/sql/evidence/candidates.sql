-- The n-gram evidence in steps (forensics/queries/evidence.py), step 2: the candidate (response,
-- donor, hash) triples of exposure_ngrams.sql, from _ng - the output rows of at least every pair's
-- response (step 1) - and _hits - every row of at least each hash those outputs hold (rows of other
-- incarnations or hashes change nothing: every use joins on a pair and an output hash).
WITH blocked AS (
    SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation'
),
pairs AS (
    SELECT DISTINCT response, donor FROM exposure_runs ANTI JOIN blocked USING (response) WHERE donor <> -1
),
out AS MATERIALIZED (
    SELECT DISTINCT incarnation AS response, hash FROM _ng WHERE role = 'output'
),
prompt AS MATERIALIZED (    -- only a hash some output holds can match or be a response's own: at 121 M
                            -- read rows 2.1 M prompt rows -> 0.1 M, the step 0.2 -> 0.1 s (ro is made
                            -- first, on its own: joined in one query with prompt, DuckDB may join out to
                            -- prompt on the hash alone - 5 s where exposure_runs is a table)
    SELECT incarnation, hash, pos, n FROM _hits WHERE role = 'prompt' AND hash IN (SELECT hash FROM out)
),
ro AS MATERIALIZED (        -- (out's rows are distinct: so are these)
    SELECT m.response, m.donor, o.hash FROM pairs m JOIN out o USING (response)
),
matched AS MATERIALIZED (
    SELECT DISTINCT r.response, r.donor, r.hash, p.pos, p.n
    FROM ro r JOIN prompt p ON p.incarnation = r.donor AND p.hash = r.hash
),
in_read AS (        -- an n-gram [pos, pos + n) the response read a position of: one that meets a run
                    -- of the pair's read positions (_read_runs: step 1a)
    SELECT DISTINCT m.response, m.donor, m.hash
    FROM matched m JOIN _read_runs r ON r.response = m.response AND r.donor = m.donor
    WHERE m.pos IS NOT NULL AND r.lo < m.pos + m.n AND r.hi >= m.pos
)
SELECT * FROM (
    SELECT response, donor, hash FROM in_read
    UNION
    SELECT response, donor, hash FROM matched WHERE pos IS NULL
) c
ANTI JOIN (SELECT incarnation AS response, hash FROM prompt) own USING (response, hash)
