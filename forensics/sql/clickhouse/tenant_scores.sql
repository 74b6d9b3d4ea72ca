-- Exposure score per recipient tenant and bucket_s-second window (see ../tenant_scores.sql). Windows
-- start where DuckDB's time_bucket starts them: at multiples of the width from 2000-01-03 00:00 UTC.
SELECT window_start, tenant, responses, surfaced_responses, foreign_tokens, score FROM (
    SELECT toDateTime64(fromUnixTimestamp64Nano(toInt64(946857600000000000 + intDiv(toUnixTimestamp64Nano(first_read)
               - 946857600000000000, {bucket_s:Int64} * 1000000000) * {bucket_s:Int64} * 1000000000), 'UTC'), 6, 'UTC')
               AS window_start,
           tenant, toInt64(count()) AS responses, toInt64(countIf(surfaced)) AS surfaced_responses,
           toInt64(sum(foreign_tokens)) AS foreign_tokens, toInt64(sum(score)) AS score
    FROM (@scores_in@)
    GROUP BY window_start, tenant
)
ORDER BY window_start, score DESC, tenant
