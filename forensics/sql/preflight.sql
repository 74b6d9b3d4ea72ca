-- Per node, its latest configuration snapshot: KV pool capacity in tokens against the advertised
-- context length (pool_fits_context false = a prompt can be longer than the pool: the incident's
-- precondition), policy, guards and isolation level; plus every earlier snapshot count.
-- The latest snapshot's time and the count per (node, boot) come from the narrow columns first; the
-- wide ones (the guards map, strings) are carried through the window only for the snapshots at that
-- time (a ties' pick as arbitrary as one window over every row): at the forensics bench's 97 K
-- snapshots 0.094 -> 0.052 s (one-off, the fifty-fifth session's AMD EPYC).
WITH latest AS MATERIALIZED (
    SELECT node, boot, max(ts) AS ts, count(*) AS snapshots FROM config_snapshots GROUP BY node, boot
)
SELECT c.node, c.boot, role, pool_tokens, advertised_context, context_length AS served_context,
       round(pool_tokens / advertised_context, 4) AS pool_over_context, pool_fits_context, preflight_action, policy, guards, isolation_level, model, kvledger_version, c.ts AS snapshot_at,
       l.snapshots
FROM config_snapshots c
JOIN latest l ON c.node IS NOT DISTINCT FROM l.node AND c.boot IS NOT DISTINCT FROM l.boot AND c.ts IS NOT DISTINCT FROM l.ts
QUALIFY row_number() OVER (PARTITION BY c.node, c.boot ORDER BY c.ts DESC) = 1
ORDER BY pool_fits_context, node, snapshot_at, boot
