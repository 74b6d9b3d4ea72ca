-- TTFT against uncached prompt tokens on a foreign fleet's request spans, Theil-Sen fit per
-- instance over a deterministic sample of up to 200 requests; below_floor where a prefix-cache hit
-- is ruled out, cache_hit_possible where it is not; the tenant through the trace (see ../fleet_ttft.sql).
WITH trace_tenant AS (
    SELECT "TraceId" AS trace_id, min(tenant_h) AS gateway_tenant_h FROM spans
    WHERE tenant_h IS NOT NULL AND "TraceId" != '' GROUP BY trace_id
),
hits AS (
    SELECT node AS instance, ts, sum(value) AS hits FROM metrics
    WHERE name IN ('vllm:prefix_cache_hits_total', 'sglang:cache_hit_tokens_total') GROUP BY instance, ts
),
r0 AS (
    SELECT s.node AS instance, s.request_id AS request_id, coalesce(s.tenant_h, tt.gateway_tenant_h) AS tenant_h,
           s."Timestamp" AS arrived_at,
           s."Timestamp" + toIntervalMicrosecond(toInt64(s.ttft_s * 1e6)) AS answered_at, s."SpanId" AS span_id,
           s.input_tokens AS prompt_tokens_billed, s.cached_tokens AS prompt_tokens_cached,
           s.prefilled_tokens AS prompt_tokens_prefilled,
           s.input_tokens - coalesce(s.cached_tokens, 0) AS uncached_tokens, s.output_tokens AS output_tokens,
           s.ttft_s AS ttft_s
    FROM spans AS s LEFT JOIN trace_tenant AS tt ON tt.trace_id = s."TraceId"
    WHERE s.incarnation IS NULL AND s.input_tokens IS NOT NULL AND s.ttft_s IS NOT NULL
      AND s."Timestamp" BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
),
r1 AS (
    SELECT r0.*, hb.hits AS hits_before
    FROM r0 ASOF LEFT JOIN hits AS hb ON hb.instance = r0.instance AND r0.arrived_at >= hb.ts
),
r AS (
    SELECT r1.*, ha.hits AS hits_after,
           multiIf(r1.prompt_tokens_cached IS NOT NULL OR r1.prompt_tokens_prefilled IS NOT NULL, 'reported',
                   r1.hits_before IS NULL OR ha.hits IS NULL, 'unknown',
                   ha.hits > r1.hits_before, 'hits rose', 'no hits') AS cache_evidence
    FROM r1 ASOF LEFT JOIN hits AS ha ON ha.instance = r1.instance AND r1.answered_at <= ha.ts
),
s AS (
    SELECT instance, uncached_tokens AS x, ttft_s AS y FROM (
        SELECT instance, uncached_tokens, ttft_s,
               row_number() OVER (PARTITION BY instance ORDER BY lower(hex(MD5(span_id))), span_id) AS k FROM r)
    WHERE k <= 200
),
slope AS (
    SELECT a.instance AS instance, quantileExactInclusive(0.5)((b.y - a.y) / (b.x - a.x)) AS s_per_token
    FROM s AS a JOIN s AS b ON a.instance = b.instance
    WHERE b.x > a.x
    GROUP BY a.instance
),
fit AS (
    SELECT s.instance AS instance, any(slope.s_per_token) AS s_per_token,
           quantileExactInclusive(0.5)(s.y - slope.s_per_token * s.x) AS base_s, toInt64(count()) AS fitted_on
    FROM s JOIN slope ON slope.instance = s.instance GROUP BY s.instance
)
SELECT r.instance AS instance, r.request_id AS request_id, r.tenant_h AS tenant_h,
       r.prompt_tokens_billed AS prompt_tokens_billed, r.prompt_tokens_cached AS prompt_tokens_cached,
       r.uncached_tokens AS uncached_tokens, r.output_tokens AS output_tokens, r.ttft_s AS ttft_s,
       f.base_s + f.s_per_token * r.uncached_tokens AS ttft_expected_s,
       {slack:Float64} * (f.base_s + f.s_per_token * r.uncached_tokens) AS ttft_floor_s, f.fitted_on AS fitted_on,
       toBool(coalesce(f.s_per_token > 0 AND r.ttft_s < {slack:Float64} * (f.base_s + f.s_per_token * r.uncached_tokens)
                       AND r.cache_evidence IN ('reported', 'no hits'), false)) AS below_floor,
       toBool(coalesce(f.s_per_token > 0 AND r.ttft_s < {slack:Float64} * (f.base_s + f.s_per_token * r.uncached_tokens)
                       AND r.cache_evidence IN ('hits rose', 'unknown'), false)) AS cache_hit_possible,
       r.cache_evidence AS cache_evidence,
       if(r.prompt_tokens_prefilled IS NULL, NULL,
          toBool(r.prompt_tokens_billed > r.prompt_tokens_prefilled + coalesce(r.prompt_tokens_cached, 0)))
           AS usage_dishonest,
       r.arrived_at AS arrived_at
FROM r LEFT JOIN fit AS f ON f.instance = r.instance
ORDER BY below_floor DESC, arrived_at, instance, request_id
