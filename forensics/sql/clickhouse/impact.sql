-- Responses whose billed prompt tokens exceed the KV pool of the node that prefilled them (see ../impact.sql).
WITH prefill_span AS (
    SELECT incarnation, any(node) AS node FROM spans
    WHERE operation = 'prefill' AND incarnation IS NOT NULL GROUP BY incarnation
),
prefill_node AS (
    SELECT r.incarnation AS incarnation, r.boot AS boot, coalesce(t.src_node, p.node, r.node) AS prefill_node
    FROM requests AS r LEFT JOIN transfers AS t ON t.incarnation = r.incarnation
         LEFT JOIN prefill_span AS p ON p.incarnation = r.incarnation
),
pool AS (
    SELECT node, boot, argMax(pool_tokens, ts) AS pool_tokens FROM config_snapshots GROUP BY node, boot
)
SELECT r.incarnation AS incarnation, r.tenant_h AS tenant_h, r.arrived_at AS arrived_at, p.prefill_node AS prefill_node,
       r.prompt_tokens_billed AS prompt_tokens_billed, pool.pool_tokens AS pool_tokens,
       r.prompt_tokens_prefilled AS prompt_tokens_prefilled, r.finish_reason AS finish_reason,
       r.error_type AS error_type, toBool(r.error IS NOT NULL AND r.error != '') AS errored
FROM requests AS r
JOIN prefill_node AS p ON p.incarnation = r.incarnation
JOIN pool ON pool.node = p.prefill_node AND pool.boot = p.boot
WHERE r.prompt_tokens_billed > pool.pool_tokens
  AND r.arrived_at BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
ORDER BY arrived_at, incarnation
