-- Guard liveness: each guard's switch and the checks it ran (see ../guards.sql).
WITH latest AS (
    SELECT node, boot, guards FROM config_snapshots
    QUALIFY row_number() OVER (PARTITION BY node, boot ORDER BY ts DESC) = 1
),
cfg AS (
    SELECT node, boot, guard, enabled FROM latest ARRAY JOIN mapKeys(guards) AS guard, mapValues(guards) AS enabled
),
pts AS (
    SELECT node, boot, attributes['kvledger.guard'] AS guard, attributes['result'] AS result, argMax(value, ts) AS checks
    FROM metrics WHERE name = 'kvledger.guard.checks' GROUP BY node, boot, guard, result
),
g AS (
    SELECT guard, toBool(max(enabled)) AS any_on, arraySort(groupUniqArrayIf(node, enabled)) AS on_nodes
    FROM cfg GROUP BY guard
)
SELECT g.guard AS guard, g.any_on AS enabled, g.on_nodes AS on_nodes,
       toInt64(coalesce(sum(pts.checks), 0)) AS checks,
       toInt64(coalesce(sumIf(pts.checks, pts.result = 'fail'), 0)) AS failed,
       g.any_on AND coalesce(sum(pts.checks), 0) = 0 AS idle_but_on
FROM g LEFT JOIN pts ON pts.guard = g.guard
GROUP BY g.guard, g.any_on, g.on_nodes
ORDER BY idle_but_on DESC, guard
