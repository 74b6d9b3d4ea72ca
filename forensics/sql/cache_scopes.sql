-- Block hashes a foreign engine published as stored under more than one cache scope (kv_events):
-- an engine or KV connector that leaves the cache salt out of the block hash shares those blocks
-- across the scopes (the LMCache / event-hash bugs upstream). A scope is the keyed pseudonym of
-- the chain's first block's extra keys (where vLLM puts cache_salt); later blocks inherit it.
WITH stored AS (
    SELECT instance, boot, unnest(block_hashes) AS block_hash, scope_h, ts
    FROM kv_events
    WHERE kind = 'BlockStored' AND scope_h IS NOT NULL
)
SELECT instance, block_hash, count(DISTINCT scope_h) AS scopes,
       list(DISTINCT scope_h ORDER BY scope_h) AS scopes_h, count(*) AS times_stored,
       min(ts) AS first_stored, max(ts) AS last_stored
FROM stored
GROUP BY instance, block_hash
HAVING count(DISTINCT scope_h) > 1
ORDER BY first_stored, instance, block_hash
