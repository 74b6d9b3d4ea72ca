-- Table macro scores_in(t0, t1): the exposure score per response (README: "Exposure score"):
-- tokens of other requests' KV the response read (unwritten slots carry no one's data and count
-- 0), times 10 when any of it surfaced in the response's output. Blocked reads (the read check
-- stopped the response; it returned nothing) are not exposures and score nothing.
CREATE OR REPLACE MACRO scores_in(t0, t1) AS TABLE
SELECT response, any_value(response_tenant) AS tenant,
       sum(CASE WHEN donor = -1 THEN 0 ELSE foreign_tokens END)::BIGINT AS foreign_tokens,
       count(DISTINCT donor) FILTER (WHERE donor <> -1) AS donors,
       bool_or(evidence = 'surfaced') AS surfaced,
       (sum(CASE WHEN donor = -1 THEN 0 ELSE foreign_tokens END)
        * CASE WHEN bool_or(evidence = 'surfaced') THEN 10 ELSE 1 END)::BIGINT AS score,
       min(first_read) AS first_read, max(last_read) AS last_read, bool_and(response_finished) AS response_finished
FROM exposures_in(t0, t1)
WHERE evidence <> 'blocked'
GROUP BY response
