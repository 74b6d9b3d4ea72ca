-- One row per (response incarnation, donor incarnation) with failing reads overlapping [from, to]
-- (see ../exposures_in.sql: the columns and the evidence levels). Included by @exposures_in@.
WITH e AS (
    SELECT * FROM exposure_slots WHERE ts_first <= {to:DateTime64(9, 'UTC')} AND ts_last >= {from:DateTime64(9, 'UTC')}
),
runs AS (   -- mass is per read run and page, not per slot: count each run once
    SELECT DISTINCT response, donor, node, boot, page, block_index, lclock_first, attention_mass FROM e
),
mass AS (
    SELECT response, donor, sumKahan(attention_mass) AS attention_mass FROM runs GROUP BY response, donor
)
SELECT e.response AS response, r.tenant_h AS response_tenant, e.donor AS donor, d.tenant_h AS donor_tenant,
       toBool(coalesce(r.tenant_h = d.tenant_h, false)) AS same_tenant,
       any(e.boot) AS boot,
       arraySort(groupUniqArray(e.kind)) AS kinds,
       toInt64(uniqExact(e.node, e.boot, e.page)) AS pages,
       arrayMap(x -> concat(x.1, ':', toString(x.2)), arraySort(groupUniqArray((e.node, e.page)))) AS node_pages,
       toInt64(uniqExact(e.node, e.boot, e.position)) AS foreign_tokens,
       any(m.attention_mass) AS attention_mass,
       CASE WHEN any(r.error_type) = 'ReadCheckViolation' THEN 'blocked'
            WHEN any(s.shared_ngrams) > 0 THEN 'surfaced' ELSE 'read' END AS evidence,
       toInt64(coalesce(any(s.shared_ngrams), 0)) AS shared_ngrams,
       toBool(coalesce(any(r.finished), false)) AS response_finished,
       min(e.step_first) AS first_step, max(e.step_last) AS last_step,
       min(e.ts_first) AS first_read, max(e.ts_last) AS last_read
FROM e
JOIN mass AS m ON m.response = e.response AND m.donor = e.donor
LEFT JOIN exposure_ngrams AS s ON s.response = e.response AND s.donor = e.donor
LEFT JOIN requests AS r ON r.incarnation = e.response
LEFT JOIN requests AS d ON d.incarnation = e.donor
GROUP BY e.response, r.tenant_h, e.donor, d.tenant_h
ORDER BY first_read, response, donor
