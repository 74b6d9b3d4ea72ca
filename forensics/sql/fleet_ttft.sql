-- TTFT against uncached prompt tokens on a foreign fleet's request spans (`kvledger collect`:
-- spans with no kvledger incarnation), in [$from, $to]. No list of healthy requests exists there, so
-- each instance's expected TTFT is fitted robustly from its own traffic: a Theil-Sen line (the
-- median of pairwise slopes, then the median intercept) over a deterministic sample of up to 200
-- requests, which up to ~29 % outliers - skipped prefills among them - do not bend.
-- below_floor: answered in under $slack x the expected TTFT of its length (prefill skipped?), where
-- a prefix-cache hit is ruled out: the span reports what it computed or had cached, or its
-- instance's scraped prefix-cache hit counter (`collect --scrape`: vllm:prefix_cache_hits_total)
-- did not rise between the scrape before the request and the first one after its first token.
-- cache_hit_possible: as fast, but the counter rose meanwhile, or nothing tells (no count on the
-- span, no scrape of its instance): a cache hit could explain it, so it is not called a skip.
-- tenant_h: the span's own, else that of another span in the same trace (a gateway's span carries
-- the tenant - our `serve`, any OTel-instrumented proxy - and vLLM continues its traceparent).
-- usage_dishonest: billed for more prompt than it computed or had cached, where the engine reports
-- what it computed (kvledger.prompt_tokens.prefilled); NULL where it does not.
WITH trace_tenant AS (
    SELECT "TraceId" AS trace_id, min(tenant_h) AS tenant_h FROM spans
    WHERE tenant_h IS NOT NULL AND "TraceId" <> '' GROUP BY ALL
),
hits AS (
    SELECT node AS instance, ts, sum(value) AS hits FROM metrics
    WHERE name IN ('vllm:prefix_cache_hits_total', 'sglang:cache_hit_tokens_total') GROUP BY ALL
),
r0 AS (
    SELECT node AS instance, request_id, coalesce(s.tenant_h, tt.tenant_h) AS tenant_h, "Timestamp" AS arrived_at,
           "Timestamp" + to_microseconds(CAST(ttft_s * 1e6 AS BIGINT)) AS answered_at, "SpanId" AS span_id,
           input_tokens AS prompt_tokens_billed, cached_tokens AS prompt_tokens_cached,
           prefilled_tokens AS prompt_tokens_prefilled,
           input_tokens - coalesce(cached_tokens, 0) AS uncached_tokens, output_tokens, ttft_s
    FROM spans s LEFT JOIN trace_tenant tt ON tt.trace_id = s."TraceId"
    WHERE incarnation IS NULL AND input_tokens IS NOT NULL AND ttft_s IS NOT NULL
      AND "Timestamp" BETWEEN $from AND $to
),
r1 AS (
    SELECT r0.*, hb.hits AS hits_before FROM r0 ASOF LEFT JOIN hits hb
        ON hb.instance = r0.instance AND r0.arrived_at >= hb.ts
),
r AS (
    SELECT r1.*, ha.hits AS hits_after,
           CASE WHEN r1.prompt_tokens_cached IS NOT NULL OR r1.prompt_tokens_prefilled IS NOT NULL THEN 'reported'
                WHEN r1.hits_before IS NULL OR ha.hits IS NULL THEN 'unknown'
                WHEN ha.hits > r1.hits_before THEN 'hits rose' ELSE 'no hits' END AS cache_evidence
    FROM r1 ASOF LEFT JOIN hits ha ON ha.instance = r1.instance AND r1.answered_at <= ha.ts
),
s AS (
    SELECT instance, uncached_tokens AS x, ttft_s AS y FROM (
        SELECT *, row_number() OVER (PARTITION BY instance ORDER BY md5(span_id), span_id) AS k FROM r) WHERE k <= 200
),
slope AS (
    SELECT a.instance, median((b.y - a.y) / (b.x - a.x)) AS s_per_token
    FROM s a JOIN s b ON a.instance = b.instance AND b.x > a.x
    GROUP BY a.instance
),
fit AS (
    SELECT s.instance, any_value(slope.s_per_token) AS s_per_token, median(s.y - slope.s_per_token * s.x) AS base_s,
           count(*) AS fitted_on
    FROM s JOIN slope USING (instance) GROUP BY s.instance
)
SELECT r.instance, r.request_id, r.tenant_h, r.prompt_tokens_billed, r.prompt_tokens_cached, r.uncached_tokens,
       r.output_tokens, r.ttft_s, f.base_s + f.s_per_token * r.uncached_tokens AS ttft_expected_s,
       $slack * (f.base_s + f.s_per_token * r.uncached_tokens) AS ttft_floor_s, f.fitted_on,
       coalesce(f.s_per_token > 0 AND r.ttft_s < $slack * (f.base_s + f.s_per_token * r.uncached_tokens)
                AND r.cache_evidence IN ('reported', 'no hits'), false) AS below_floor,
       coalesce(f.s_per_token > 0 AND r.ttft_s < $slack * (f.base_s + f.s_per_token * r.uncached_tokens)
                AND r.cache_evidence IN ('hits rose', 'unknown'), false) AS cache_hit_possible,
       r.cache_evidence,
       r.prompt_tokens_billed > r.prompt_tokens_prefilled + coalesce(r.prompt_tokens_cached, 0) AS usage_dishonest,
       r.arrived_at
FROM r LEFT JOIN fit f USING (instance)
ORDER BY below_floor DESC, r.arrived_at, r.instance, r.request_id
