-- How many requests got a first token in [from, to] (see ../served.sql).
SELECT toInt64(count()) AS served FROM requests
WHERE ttft_s IS NOT NULL AND arrived_at BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
