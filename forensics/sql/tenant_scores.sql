-- Exposure score per recipient tenant and window in [$from, $to]: the scores of the tenant's
-- responses (scores_in.sql) added up per $bucket_s-second window of their first foreign read.
SELECT time_bucket(to_seconds($bucket_s::BIGINT), first_read) AS window_start, tenant,
       count(*) AS responses, count(*) FILTER (WHERE surfaced) AS surfaced_responses,
       sum(foreign_tokens)::BIGINT AS foreign_tokens, sum(score)::BIGINT AS score
FROM scores_in($from, $to)
GROUP BY ALL
ORDER BY window_start, score DESC, tenant
