-- TTFT against uncached prompt tokens on a foreign fleet's request spans, Theil-Sen fit per
-- instance over a deterministic sample of up to 200 requests (see ../fleet_ttft.sql).
WITH r AS (
    SELECT node AS instance, request_id, tenant_h, "Timestamp" AS arrived_at, "SpanId" AS span_id,
           input_tokens AS prompt_tokens_billed, cached_tokens AS prompt_tokens_cached,
           prefilled_tokens AS prompt_tokens_prefilled,
           input_tokens - coalesce(cached_tokens, 0) AS uncached_tokens, output_tokens, ttft_s
    FROM spans
    WHERE incarnation IS NULL AND input_tokens IS NOT NULL AND ttft_s IS NOT NULL
      AND "Timestamp" BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
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
       toBool(coalesce(f.s_per_token > 0 AND r.ttft_s < {slack:Float64} * (f.base_s + f.s_per_token * r.uncached_tokens),
                       false)) AS below_floor,
       if(r.prompt_tokens_prefilled IS NULL, NULL,
          toBool(r.prompt_tokens_billed > r.prompt_tokens_prefilled + coalesce(r.prompt_tokens_cached, 0)))
           AS usage_dishonest,
       r.arrived_at AS arrived_at
FROM r LEFT JOIN fit AS f ON f.instance = r.instance
ORDER BY below_floor DESC, arrived_at, instance, request_id
