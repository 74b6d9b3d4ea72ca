-- Page releases in [from, to]: immediate vs deferred, hold time, timeouts (see ../releases.sql).
SELECT node, kind, ended_by, toInt64(count()) AS releases, toInt64(sum(length(pages))) AS pages,
       max(hold_ns) / 1e6 AS max_hold_ms, avg(hold_ns) / 1e6 AS mean_hold_ms
FROM releases
WHERE ts BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
GROUP BY node, kind, ended_by
ORDER BY ended_by = 'timeout' DESC, node, kind
