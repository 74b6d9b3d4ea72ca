-- Exposure score per response in [from, to] (see scores_in.sql).
SELECT * FROM (@scores_in@) ORDER BY score DESC, first_read, response
