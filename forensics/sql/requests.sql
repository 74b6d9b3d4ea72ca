-- One row per kvledger request incarnation: from its root span when it finished (hot fields are
-- typed columns), else from its arrival (a response still running, or cut off by a crash:
-- finished false, its tenant and prompt known, everything the end would have told NULL).
-- A request has one root span: rows are grouped (any_value) only for an incarnation with more than
-- one, and arrivals only for requests without an end - grouping every row by incarnation copied
-- every string of every request into the aggregate (a third of this table's build).
WITH req AS NOT MATERIALIZED (
    SELECT incarnation, node, boot, tenant_h, scope_h, "Timestamp" AS arrived_at,
           "Timestamp" + to_microseconds(("Duration" // 1000)::BIGINT) AS finished_at,
           input_tokens AS prompt_tokens_billed, prefilled_tokens AS prompt_tokens_prefilled,
           cached_tokens AS prompt_tokens_cached, output_tokens, ttft_s, finish_reason, error_type,
           rejected_at, "StatusMessage" AS error, true AS finished
    FROM spans
    WHERE operation = 'request' AND incarnation IS NOT NULL   -- a foreign engine's request spans have none (fleet_*)
),
twice AS (
    SELECT incarnation FROM req GROUP BY incarnation HAVING count(*) > 1
),
done AS (
    SELECT * FROM req ANTI JOIN twice USING (incarnation)
    UNION ALL
    SELECT incarnation, any_value(COLUMNS(* EXCLUDE (incarnation))) FROM req SEMI JOIN twice USING (incarnation)
    GROUP BY incarnation
),
arrived AS (
    SELECT incarnation, arg_min(node, ts) AS node, any_value(boot) AS boot, any_value(tenant_h) AS tenant_h,
           any_value(scope_h) AS scope_h, min(ts) AS arrived_at, max(prompt_tokens) AS prompt_tokens
    FROM arrivals ANTI JOIN done USING (incarnation)
    GROUP BY incarnation
)
SELECT * FROM done
UNION ALL
SELECT incarnation, node, boot, tenant_h, scope_h, arrived_at, NULL, prompt_tokens, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, false
FROM arrived
