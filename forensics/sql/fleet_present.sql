-- Whether [$from, $to] holds any foreign request span (no kvledger incarnation, a prompt billed):
-- every row of fleet_ttft and fleet_impact is one. `ttft`, `impact` and `tenants` answered from the
-- page ledger run their fleet twin only for their note where this is true (fleet.folded) - the twins
-- group every span by trace for its tenant (0.4 s of a first `tenants` at 121 M read rows).
SELECT count(*) > 0 AS present
FROM (SELECT 1 FROM spans
      WHERE incarnation IS NULL AND input_tokens IS NOT NULL AND "Timestamp" BETWEEN $from AND $to
      LIMIT 1)
