-- Block hashes a foreign engine stored under more than one cache scope (see ../cache_scopes.sql).
SELECT instance, block_hash, toInt64(uniqExact(scope_h)) AS scopes, arraySort(groupUniqArray(scope_h)) AS scopes_h,
       toInt64(count()) AS times_stored, min(ts) AS first_stored, max(ts) AS last_stored
FROM (
    SELECT instance, arrayJoin(block_hashes) AS block_hash, scope_h, ts
    FROM kv_events
    WHERE kind = 'BlockStored' AND scope_h IS NOT NULL
)
GROUP BY instance, block_hash
HAVING uniqExact(scope_h) > 1
ORDER BY first_stored, instance, block_hash
