-- Whether each run (boot) recorded a page ledger - page reads and writes - and so whether which
-- pages its responses read can be established at all: runs.sql's page_ledger column, alone, for
-- what needs only it (a command's coverage warning). Stores written before the flag existed: a
-- run with any page write recorded one. (A view of the reader's snapshot: runs.sql reads it.)
WITH cfg AS (
    SELECT boot, min(ts) AS started_at, bool_and(page_ledger) AS declared
    FROM config_snapshots GROUP BY boot
),
wrote AS (
    SELECT DISTINCT boot FROM page_writes WHERE boot IN (SELECT boot FROM cfg WHERE declared IS NULL)
)
SELECT cfg.boot, cfg.started_at, coalesce(cfg.declared, wrote.boot IS NOT NULL) AS page_ledger
FROM cfg LEFT JOIN wrote USING (boot)
