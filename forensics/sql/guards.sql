-- Guard liveness across the deployment: each guard's switch (latest config snapshot of every
-- node) and the checks it ran (latest cumulative metric point per node, summed).
-- idle_but_on: a guard that is on and ran zero checks - protection that is not happening.
WITH cfg AS (
    SELECT node, boot, unnest(map_keys(guards)) AS guard, unnest(map_values(guards)) AS enabled
    FROM config_snapshots
    QUALIFY row_number() OVER (PARTITION BY node, boot ORDER BY ts DESC) = 1
),
pts AS (
    SELECT node, boot, attributes['kvledger.guard'] AS guard, attributes['result'] AS result, arg_max(value, ts) AS checks
    FROM metrics WHERE name = 'kvledger.guard.checks' GROUP BY ALL
),
g AS (
    SELECT guard, bool_or(enabled) AS enabled, coalesce(list(DISTINCT node ORDER BY node) FILTER (WHERE enabled), []) AS on_nodes
    FROM cfg GROUP BY guard
)
SELECT g.guard, g.enabled, g.on_nodes,
       coalesce(sum(pts.checks), 0)::BIGINT AS checks,
       coalesce(sum(pts.checks) FILTER (WHERE pts.result = 'fail'), 0)::BIGINT AS failed,
       g.enabled AND coalesce(sum(pts.checks), 0) = 0 AS idle_but_on
FROM g LEFT JOIN pts ON pts.guard = g.guard
GROUP BY g.guard, g.enabled, g.on_nodes
ORDER BY idle_but_on DESC, g.guard
