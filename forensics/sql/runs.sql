-- The runs a store holds: one row per boot (a start of a deployment), oldest first: its nodes
-- and their roles, the policy and isolation level they ran under, the requests it served, how
-- many of those had not finished when the store was read (still running, or cut off: unfinished),
-- how many responses read foreign KV (blocked reads aside), and its first and last recorded times.
-- page_ledger: the run recorded page reads and writes. Without them which pages a response read
-- cannot be established: exposed_responses is then NULL (unknown), never 0 (page_ledgers.sql:
-- stores written before the flag existed count a run with any page write as one that recorded it).
-- `--run BOOT` on any query (or a unique prefix of it) answers for that run alone.
WITH cfg AS (
    SELECT boot, list(DISTINCT node || ' (' || role || ')' ORDER BY node || ' (' || role || ')') AS nodes,
           string_agg(DISTINCT policy, ',' ORDER BY policy) AS policy,
           string_agg(DISTINCT isolation_level, ',' ORDER BY isolation_level) AS isolation_level,
           any_value(model ORDER BY ts) AS model, min(ts) AS started_at
    FROM config_snapshots GROUP BY boot
),
req AS (
    SELECT boot, count(*) AS requests, count(*) FILTER (WHERE NOT finished) AS unfinished,
           min(arrived_at) AS first_request, max(coalesce(finished_at, arrived_at)) AS last_request
    FROM requests GROUP BY boot
),
exposed AS (
    SELECT boot, count(DISTINCT response) AS responses_reading_foreign_kv
    FROM exposure_slots
    WHERE response NOT IN (SELECT incarnation FROM requests WHERE error_type = 'ReadCheckViolation')
    GROUP BY boot
)
SELECT cfg.boot, cfg.policy, cfg.nodes, cfg.isolation_level, cfg.model,
       coalesce(req.requests, 0) AS requests, coalesce(req.unfinished, 0) AS unfinished,
       CASE WHEN l.page_ledger THEN coalesce(exposed.responses_reading_foreign_kv, 0) END AS exposed_responses,
       cfg.started_at, greatest(cfg.started_at, req.last_request) AS last_seen, l.page_ledger
FROM cfg LEFT JOIN req USING (boot) LEFT JOIN exposed USING (boot) LEFT JOIN page_ledgers l USING (boot)
ORDER BY cfg.started_at, cfg.boot
