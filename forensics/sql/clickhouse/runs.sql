-- The runs a store holds, one row per boot, oldest first (see ../runs.sql).
WITH cfg AS (
    SELECT boot, arraySort(groupUniqArray(concat(node, ' (', role, ')'))) AS nodes,
           arrayStringConcat(arraySort(groupUniqArray(policy)), ',') AS policy,
           arrayStringConcat(arraySort(groupUniqArray(isolation_level)), ',') AS isolation_level,
           argMin(model, ts) AS model, min(ts) AS started_at, min(page_ledger) AS declared
    FROM config_snapshots GROUP BY boot
),
wrote AS (
    SELECT DISTINCT boot, true AS any_write FROM page_writes WHERE boot IN (SELECT boot FROM cfg WHERE declared IS NULL)
),
req AS (
    SELECT boot, toInt64(count()) AS requests, toInt64(countIf(NOT finished)) AS unfinished,
           min(arrived_at) AS first_request, max(coalesce(finished_at, arrived_at)) AS last_request
    FROM requests GROUP BY boot
),
exposed AS (
    SELECT boot, toInt64(uniqExact(response)) AS responses_reading_foreign_kv
    FROM exposure_slots
    WHERE response NOT IN (SELECT incarnation FROM requests WHERE error_type = 'ReadCheckViolation')
    GROUP BY boot
)
SELECT cfg.boot AS boot, cfg.policy AS policy, cfg.nodes AS nodes, cfg.isolation_level AS isolation_level,
       cfg.model AS model, coalesce(req.requests, 0) AS requests, coalesce(req.unfinished, 0) AS unfinished,
       if(coalesce(cfg.declared, wrote.any_write, false), coalesce(exposed.responses_reading_foreign_kv, 0),
          CAST(NULL AS Nullable(Int64))) AS exposed_responses,
       cfg.started_at AS started_at, greatest(cfg.started_at, req.last_request) AS last_seen,
       coalesce(cfg.declared, wrote.any_write, false) AS page_ledger
FROM cfg LEFT JOIN req ON req.boot = cfg.boot LEFT JOIN exposed ON exposed.boot = cfg.boot
     LEFT JOIN wrote ON wrote.boot = cfg.boot
ORDER BY started_at, boot
