-- Time to first token against uncached prompt tokens, the floor, and usage honesty (see ../ttft.sql).
WITH q AS (
    SELECT incarnation, sum("Duration") / 1e9 AS queue_s FROM spans WHERE operation = 'admission' GROUP BY incarnation
),
r AS (
    SELECT r.incarnation AS incarnation, r.node AS node, r.tenant_h AS tenant_h,
           r.prompt_tokens_billed AS prompt_tokens_billed, r.prompt_tokens_prefilled AS prompt_tokens_prefilled,
           r.prompt_tokens_cached AS prompt_tokens_cached, r.output_tokens AS output_tokens, r.ttft_s AS ttft_s,
           r.finish_reason AS finish_reason, r.arrived_at AS arrived_at,
           coalesce(q.queue_s, 0) AS queue_s, r.ttft_s - coalesce(q.queue_s, 0) AS service_ttft_s,
           r.prompt_tokens_billed - coalesce(r.prompt_tokens_cached, 0) AS uncached_tokens
    FROM requests AS r LEFT JOIN q ON q.incarnation = r.incarnation
    WHERE r.ttft_s IS NOT NULL AND r.arrived_at BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
),
healthy AS (
    SELECT * FROM r
    WHERE prompt_tokens_billed <= prompt_tokens_prefilled + coalesce(prompt_tokens_cached, 0)
      AND incarnation NOT IN (    -- exposures_in's responses, from exposure_slots: no n-gram evidence needed
          SELECT response FROM exposure_slots
          WHERE ts_first <= {to:DateTime64(9, 'UTC')} AND ts_last >= {from:DateTime64(9, 'UTC')})
      AND prompt_tokens_prefilled >= {min_tokens:Int64}
),
rate AS (
    SELECT min(service_ttft_s / prompt_tokens_prefilled) AS s_per_token, toInt64(count()) AS healthy_requests FROM healthy
)
SELECT r.incarnation AS incarnation, r.node AS node, r.tenant_h AS tenant_h, r.prompt_tokens_billed AS prompt_tokens_billed,
       r.prompt_tokens_prefilled AS prompt_tokens_prefilled, r.prompt_tokens_cached AS prompt_tokens_cached,
       r.output_tokens AS output_tokens, r.ttft_s AS ttft_s, r.queue_s AS queue_s, r.service_ttft_s AS service_ttft_s,
       rate.s_per_token * r.uncached_tokens * {slack:Float64} AS ttft_floor_s, rate.healthy_requests AS healthy_requests,
       toBool(coalesce(r.service_ttft_s < rate.s_per_token * r.uncached_tokens * {slack:Float64}, false)) AS below_floor,
       toBool(r.prompt_tokens_billed > r.prompt_tokens_prefilled + coalesce(r.prompt_tokens_cached, 0)) AS usage_dishonest,
       r.finish_reason AS finish_reason, r.arrived_at AS arrived_at
FROM r CROSS JOIN rate
ORDER BY usage_dishonest DESC, below_floor DESC, arrived_at, incarnation
