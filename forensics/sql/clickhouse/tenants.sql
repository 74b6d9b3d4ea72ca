-- Donor tenant -> recipient tenant in [from, to] (see ../tenants.sql).
SELECT dt AS donor_tenant, recipient_tenant, same_tenant, kind AS donor_kind, responses, donor_requests, p AS pages, ft AS foreign_tokens,
       surfaced_responses
FROM (
    SELECT donor_tenant AS dt, response_tenant AS recipient_tenant, same_tenant,
           multiIf(donor = -1, 'unwritten', isNull(donor_tenant), 'unrecorded', 'tenant') AS kind,
           toInt64(uniqExact(response)) AS responses, toInt64(uniqExact(donor)) AS donor_requests,
           toInt64(sum(pages)) AS p, toInt64(sum(foreign_tokens)) AS ft,
           toInt64(uniqExactIf(response, evidence = 'surfaced')) AS surfaced_responses
    FROM (@exposures_in@)
    WHERE evidence != 'blocked'
    GROUP BY dt, recipient_tenant, same_tenant, kind
)
ORDER BY foreign_tokens DESC, donor_tenant, recipient_tenant, donor_kind
