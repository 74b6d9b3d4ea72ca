-- The exposure score per response (see ../scores_in.sql). Included by @scores_in@.
SELECT response, tenant, ft AS foreign_tokens, donors, surf AS surfaced, toInt64(ft * if(surf, 10, 1)) AS score,
       first_read, last_read, response_finished
FROM (
    SELECT response, any(response_tenant) AS tenant,
           toInt64(sum(if(donor = -1, 0, foreign_tokens))) AS ft,
           toInt64(uniqExactIf(donor, donor != -1)) AS donors,
           toBool(max(evidence = 'surfaced')) AS surf,
           min(first_read) AS first_read, max(last_read) AS last_read, toBool(min(response_finished)) AS response_finished
    FROM (@exposures_in@)
    WHERE evidence != 'blocked'
    GROUP BY response
)
