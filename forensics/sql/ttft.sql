-- Time to first token against uncached prompt tokens, in [$from, $to].
-- service_ttft = TTFT minus time queued before any work (the admission span): what prefill (and,
-- disaggregated, the KV transfer) took. The floor comes from healthy traffic (billed == prefilled
-- + cached, no exposure, at least $min_tokens prefilled): the fastest seconds per prefilled token
-- seen, times the tokens the response was billed for and did not get from cache, times $slack.
-- below_floor: answered faster than its billed prompt can be prefilled. usage_dishonest: billed
-- for more prompt tokens than were prefilled or cached - the GLM-5.3 clue.
WITH q AS (     -- queues.sql: the admission spans' time per request
    SELECT incarnation, queue_ns / 1e9 AS queue_s FROM queues
),
r AS (
    SELECT r.*, coalesce(q.queue_s, 0) AS queue_s, r.ttft_s - coalesce(q.queue_s, 0) AS service_ttft_s,
           r.prompt_tokens_billed - coalesce(r.prompt_tokens_cached, 0) AS uncached_tokens
    FROM requests r LEFT JOIN q USING (incarnation)
    WHERE r.ttft_s IS NOT NULL AND r.arrived_at BETWEEN $from AND $to
),
healthy AS (
    SELECT * FROM r
    WHERE prompt_tokens_billed <= prompt_tokens_prefilled + coalesce(prompt_tokens_cached, 0)
      AND incarnation NOT IN (SELECT response FROM exposure_pairs_in($from, $to))   -- (exposures_in's responses:
                                                                                -- no n-gram evidence needed)
      AND prompt_tokens_prefilled >= $min_tokens
),
rate AS (
    SELECT min(service_ttft_s / prompt_tokens_prefilled) AS s_per_token, count(*) AS healthy_requests FROM healthy
)
SELECT r.incarnation, r.node, r.tenant_h, r.prompt_tokens_billed, r.prompt_tokens_prefilled, r.prompt_tokens_cached,
       r.output_tokens, r.ttft_s, r.queue_s, r.service_ttft_s,
       rate.s_per_token * r.uncached_tokens * $slack AS ttft_floor_s, rate.healthy_requests,
       coalesce(r.service_ttft_s < rate.s_per_token * r.uncached_tokens * $slack, false) AS below_floor,
       r.prompt_tokens_billed > r.prompt_tokens_prefilled + coalesce(r.prompt_tokens_cached, 0) AS usage_dishonest,
       r.finish_reason, r.arrived_at
FROM r, rate
ORDER BY usage_dishonest DESC, below_floor DESC, r.arrived_at, r.incarnation
