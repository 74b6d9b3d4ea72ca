-- How long each kvledger request waited before any work (the sum of its admission spans, ns), per
-- incarnation: ttft.sql subtracts it from TTFT (service TTFT). Kept and grown with requests on a
-- live store (forensics/queries/grown.py).
SELECT incarnation, sum("Duration")::BIGINT AS queue_ns
FROM spans
WHERE operation = 'admission' AND incarnation IS NOT NULL
GROUP BY incarnation
