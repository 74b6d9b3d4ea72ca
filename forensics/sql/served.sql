-- How many requests got a first token in [$from, $to]: the rows `ttft` would return, counted
-- without computing them (the dashboard's banner needs only the count; the page's TTFT section
-- runs `ttft` itself, after the banner is drawn). Not a `kvledger forensics` command.
SELECT count(*)::BIGINT AS served FROM requests WHERE ttft_s IS NOT NULL AND arrived_at BETWEEN $from AND $to
