-- One row per request incarnation: its root span, else its arrival (see ../requests.sql).
WITH done AS (
    SELECT incarnation, any(node) AS node, any(boot) AS boot, any(tenant_h) AS tenant_h, any(scope_h) AS scope_h,
           any("Timestamp") AS arrived_at,
           any("Timestamp" + toIntervalMicrosecond(intDiv("Duration", 1000))) AS finished_at,
           any(input_tokens) AS prompt_tokens_billed, any(prefilled_tokens) AS prompt_tokens_prefilled,
           any(cached_tokens) AS prompt_tokens_cached, any(output_tokens) AS output_tokens,
           any(ttft_s) AS ttft_s, any(finish_reason) AS finish_reason, any(error_type) AS error_type,
           any(rejected_at) AS rejected_at, any("StatusMessage") AS error, true AS finished
    FROM spans
    WHERE operation = 'request' AND incarnation IS NOT NULL   -- a foreign engine's request spans have none (fleet_*)
    GROUP BY incarnation
)
SELECT * FROM done
UNION ALL
SELECT incarnation, argMin(node, ts) AS node, any(boot) AS boot, any(tenant_h) AS tenant_h, any(scope_h) AS scope_h,
       min(ts) AS arrived_at, NULL AS finished_at, max(prompt_tokens) AS prompt_tokens_billed,
       NULL AS prompt_tokens_prefilled, NULL AS prompt_tokens_cached, NULL AS output_tokens, NULL AS ttft_s,
       NULL AS finish_reason, NULL AS error_type, NULL AS rejected_at, NULL AS error, false AS finished
FROM arrivals
WHERE incarnation NOT IN (SELECT incarnation FROM done)
GROUP BY incarnation
