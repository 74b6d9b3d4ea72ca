-- One row per kvledger request incarnation: from its root span when it finished (hot fields are
-- typed columns), else from its arrival (a response still running, or cut off by a crash:
-- finished false, its tenant and prompt known, everything the end would have told NULL).
WITH done AS (
    SELECT incarnation, any_value(node) AS node, any_value(boot) AS boot, any_value(tenant_h) AS tenant_h,
           any_value(scope_h) AS scope_h, any_value("Timestamp") AS arrived_at,
           any_value("Timestamp" + to_microseconds(("Duration" // 1000)::BIGINT)) AS finished_at,
           any_value(input_tokens) AS prompt_tokens_billed, any_value(prefilled_tokens) AS prompt_tokens_prefilled,
           any_value(cached_tokens) AS prompt_tokens_cached, any_value(output_tokens) AS output_tokens,
           any_value(ttft_s) AS ttft_s, any_value(finish_reason) AS finish_reason, any_value(error_type) AS error_type,
           any_value(rejected_at) AS rejected_at, any_value("StatusMessage") AS error, true AS finished
    FROM spans
    WHERE operation = 'request' AND incarnation IS NOT NULL   -- a foreign engine's request spans have none (fleet_*)
    GROUP BY incarnation
),
arrived AS (
    SELECT incarnation, arg_min(node, ts) AS node, any_value(boot) AS boot, any_value(tenant_h) AS tenant_h,
           any_value(scope_h) AS scope_h, min(ts) AS arrived_at, max(prompt_tokens) AS prompt_tokens
    FROM arrivals GROUP BY incarnation
)
SELECT * FROM done
UNION ALL
SELECT a.incarnation, a.node, a.boot, a.tenant_h, a.scope_h, a.arrived_at, NULL, a.prompt_tokens, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, false
FROM arrived a ANTI JOIN done d USING (incarnation)
