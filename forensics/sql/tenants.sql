-- Donor tenant -> recipient tenant in the window [$from, $to]: how many responses of the
-- recipient read the donor's KV, over how many pages and tokens, and how many surfaced it.
-- Both sides are store-keyed pseudonyms. donor_kind says what the donor side is: 'tenant' (a
-- tenant's request), 'unwritten' (slots nobody wrote: no one's data, donor_tenant NULL, never a
-- tenant), 'unrecorded' (a request whose row is not in the store yet: still running, or cut off).
-- same_tenant: donor and recipient are one tenant (its own requests read each other's KV: a
-- cross-request exposure, not a cross-tenant one). Blocked reads are not exposures: left out.
SELECT donor_tenant, response_tenant AS recipient_tenant, same_tenant,
       CASE WHEN donor = -1 THEN 'unwritten' WHEN donor_tenant IS NULL THEN 'unrecorded' ELSE 'tenant' END AS donor_kind,
       count(DISTINCT response) AS responses, count(DISTINCT donor) AS donor_requests,
       sum(pages)::BIGINT AS pages, sum(foreign_tokens)::BIGINT AS foreign_tokens,
       count(DISTINCT response) FILTER (WHERE evidence = 'surfaced') AS surfaced_responses
FROM exposures_in($from, $to)
WHERE evidence <> 'blocked'
GROUP BY ALL
ORDER BY foreign_tokens DESC, donor_tenant, recipient_tenant, donor_kind
