-- One row per kvledger request incarnation, from its root span (hot fields are typed columns).
SELECT incarnation, any_value(node) AS node, any_value(boot) AS boot, any_value(tenant_h) AS tenant_h, any_value(scope_h) AS scope_h,
       any_value("Timestamp") AS arrived_at, any_value("Timestamp" + to_microseconds(("Duration" // 1000)::BIGINT)) AS finished_at,
       any_value(input_tokens) AS prompt_tokens_billed, any_value(prefilled_tokens) AS prompt_tokens_prefilled,
       any_value(cached_tokens) AS prompt_tokens_cached, any_value(output_tokens) AS output_tokens,
       any_value(ttft_s) AS ttft_s, any_value(finish_reason) AS finish_reason, any_value(error_type) AS error_type,
       any_value(rejected_at) AS rejected_at, any_value("StatusMessage") AS error
FROM spans
WHERE operation = 'request' AND incarnation IS NOT NULL   -- a foreign engine's request spans have none (fleet_*)
GROUP BY incarnation
