-- The predicate that found the 155 when nothing else was recorded: every response in
-- [$from, $to] whose billed prompt tokens exceed the KV pool of the node that prefilled it.
WITH prefill_span AS (   -- where the request was prefilled, from its own spans (no page ledger needed)
    SELECT incarnation, any_value(node) AS node FROM spans
    WHERE operation = 'prefill' AND incarnation IS NOT NULL GROUP BY incarnation
),
prefill_node AS (   -- disaggregated: the transfer's source, else the prefill span's node; unified: the node itself
    SELECT r.incarnation, r.boot, coalesce(t.src_node, p.node, r.node) AS prefill_node
    FROM requests r LEFT JOIN transfers t USING (incarnation) LEFT JOIN prefill_span p USING (incarnation)
),
pool AS (
    SELECT node, boot, arg_max(pool_tokens, ts) AS pool_tokens FROM config_snapshots GROUP BY node, boot
)
SELECT r.incarnation, r.tenant_h, r.arrived_at, p.prefill_node, r.prompt_tokens_billed, pool.pool_tokens,
       r.prompt_tokens_prefilled, r.finish_reason, r.error_type, r.error IS NOT NULL AND r.error <> '' AS errored
FROM requests r
JOIN prefill_node p USING (incarnation)
JOIN pool ON pool.node = p.prefill_node AND pool.boot = p.boot
WHERE r.prompt_tokens_billed > pool.pool_tokens AND r.arrived_at BETWEEN $from AND $to
ORDER BY r.arrived_at, r.incarnation
