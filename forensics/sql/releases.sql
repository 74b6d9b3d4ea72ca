-- Page releases in [$from, $to]: immediate vs deferred, hold time, and deferred releases that
-- ended by timeout (their pages went back while writes may still have been in flight).
SELECT node, kind, ended_by, count(*) AS releases, sum(len(pages))::BIGINT AS pages,
       max(hold_ns) / 1e6 AS max_hold_ms, avg(hold_ns) / 1e6 AS mean_hold_ms
FROM releases
WHERE ts BETWEEN $from AND $to
GROUP BY node, kind, ended_by
ORDER BY ended_by = 'timeout' DESC, node, kind
