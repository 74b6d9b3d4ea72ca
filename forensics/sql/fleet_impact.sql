-- The incident predicate on a foreign fleet: every request span in [$from, $to] billed for more
-- prompt tokens than the KV pool its instance reported at start-up (`kvledger ingest-logs`: the
-- capacity table, latest line per instance; name the log's instance as the spans'
-- service.instance.id). below_floor from fleet_ttft says whether it was also answered too fast.
WITH trace_tenant AS (      -- a gateway span's tenant, for the engine span in the same trace (see fleet_ttft)
    SELECT "TraceId" AS trace_id, min(tenant_h) AS tenant_h FROM spans
    WHERE tenant_h IS NOT NULL AND "TraceId" <> '' GROUP BY ALL
),
pool AS (
    SELECT instance, arg_max(pool_tokens, ingested_at) AS pool_tokens,
           arg_max(context_length, ingested_at) AS context_length
    FROM capacity GROUP BY instance
)
SELECT s.node AS instance, s.request_id, coalesce(s.tenant_h, tt.tenant_h) AS tenant_h, s."Timestamp" AS arrived_at, s.input_tokens AS prompt_tokens_billed,
       p.pool_tokens, p.context_length, s.output_tokens, s.ttft_s, s.finish_reason
FROM spans s JOIN pool p ON p.instance = s.node LEFT JOIN trace_tenant tt ON tt.trace_id = s."TraceId"
WHERE s.incarnation IS NULL AND s.input_tokens > p.pool_tokens AND s."Timestamp" BETWEEN $from AND $to
ORDER BY arrived_at, instance, request_id
