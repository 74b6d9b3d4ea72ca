-- Exposure score per response in [$from, $to] (see scores_in.sql and the README).
SELECT * FROM scores_in($from, $to) ORDER BY score DESC, first_read, response
