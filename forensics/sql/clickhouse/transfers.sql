-- KV transfers in [from, to]: reserved vs sent vs landed slot sets, checksums (see ../transfers.sql).
WITH t AS (
    SELECT transfer_id, seq, incarnation, src_node, dst_node, checksum_ok, checksum_dst, outcome, ts_submit, ts_landed,
           if(landed_is_reserved IS NOT NULL, n_reserved, toInt32(length(reserved_slots))) AS nr,
           if(landed_is_reserved IS NOT NULL, n_sent, toInt32(length(sent_slots))) AS ns,
           if(landed_is_reserved IS NOT NULL, n_landed, toInt32(length(landed_slots))) AS nl,
           if(landed_is_reserved IS NOT NULL, landed_is_reserved,
              landed_slots = reserved_slots OR (length(landed_slots) = length(reserved_slots)
                                                AND arraySort(landed_slots) = arraySort(reserved_slots))) AS lr
    FROM transfers
    WHERE ts_landed BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
)
SELECT transfer_id, seq, incarnation, src_node, dst_node, nr AS reserved, ns AS sent, nl AS landed,
       lr AS landed_equals_reserved, checksum_ok, toBool(checksum_dst IS NOT NULL) AS checksum_verified, outcome,
       lr AND coalesce(checksum_ok, true) AS integrity_ok,
       ts_submit, ts_landed, (toUnixTimestamp64Nano(ts_landed) - toUnixTimestamp64Nano(ts_submit)) / 1e6 AS transfer_ms
FROM t
ORDER BY ts_submit, transfer_id, incarnation
