-- TTFT against uncached prompt tokens on a foreign fleet's request spans (`kvledger collect`:
-- spans with no kvledger incarnation), in [$from, $to]. No list of healthy requests exists there, so
-- each instance's expected TTFT is fitted robustly from its own traffic: a Theil-Sen line (the
-- median of pairwise slopes, then the median intercept) over a deterministic sample of up to 200
-- requests, which up to ~29 % outliers - skipped prefills among them - do not bend.
-- below_floor: answered in under $slack x the expected TTFT of its length (prefill skipped?).
-- usage_dishonest: billed for more prompt than it computed or had cached, where the engine reports
-- what it computed (kvledger.prompt_tokens.prefilled); NULL where it does not.
WITH r AS (
    SELECT node AS instance, request_id, tenant_h, "Timestamp" AS arrived_at, "SpanId" AS span_id,
           input_tokens AS prompt_tokens_billed, cached_tokens AS prompt_tokens_cached,
           prefilled_tokens AS prompt_tokens_prefilled,
           input_tokens - coalesce(cached_tokens, 0) AS uncached_tokens, output_tokens, ttft_s
    FROM spans
    WHERE incarnation IS NULL AND input_tokens IS NOT NULL AND ttft_s IS NOT NULL
      AND "Timestamp" BETWEEN $from AND $to
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
       coalesce(f.s_per_token > 0 AND r.ttft_s < $slack * (f.base_s + f.s_per_token * r.uncached_tokens), false)
           AS below_floor,
       r.prompt_tokens_billed > r.prompt_tokens_prefilled + coalesce(r.prompt_tokens_cached, 0) AS usage_dishonest,
       r.arrived_at
FROM r LEFT JOIN fit f USING (instance)
ORDER BY below_floor DESC, r.arrived_at, r.instance, r.request_id
