-- Per node, its latest configuration snapshot: pool against context (see ../preflight.sql).
SELECT node, boot, role, pool_tokens, advertised_context, context_length AS served_context,
       round(pool_tokens / advertised_context, 4) AS pool_over_context, pool_fits_context, preflight_action, policy,
       guards, isolation_level, model, kvledger_version, ts AS snapshot_at,
       toInt64(count() OVER (PARTITION BY node, boot)) AS snapshots
FROM config_snapshots
QUALIFY row_number() OVER (PARTITION BY node, boot ORDER BY ts DESC) = 1
ORDER BY pool_fits_context, node, snapshot_at, boot
