-- Foreign request spans billed for more prompt than their instance's reported KV pool (see ../fleet_impact.sql).
WITH trace_tenant AS (      -- a gateway span's tenant, for the engine span in the same trace
    SELECT "TraceId" AS trace_id, min(tenant_h) AS gateway_tenant_h FROM spans
    WHERE tenant_h IS NOT NULL AND "TraceId" != '' GROUP BY trace_id
),
pool AS (
    SELECT instance, argMax(pool_tokens, ingested_at) AS pool_tokens, argMax(context_length, ingested_at) AS context_length
    FROM capacity GROUP BY instance
)
SELECT s.node AS instance, s.request_id AS request_id, coalesce(s.tenant_h, tt.gateway_tenant_h) AS tenant_h, s."Timestamp" AS arrived_at,
       s.input_tokens AS prompt_tokens_billed, p.pool_tokens AS pool_tokens, p.context_length AS context_length,
       s.output_tokens AS output_tokens, s.ttft_s AS ttft_s, s.finish_reason AS finish_reason
FROM spans AS s JOIN pool AS p ON p.instance = s.node LEFT JOIN trace_tenant AS tt ON tt.trace_id = s."TraceId"
WHERE s.incarnation IS NULL AND s.input_tokens > p.pool_tokens
  AND s."Timestamp" BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
ORDER BY arrived_at, instance, request_id
