-- The state a record was in before its latest takeover (NULL for a record
-- created fresh): tells a crashed holder's lapsed lease from a released key,
-- for the takeover metric and for support.
ALTER TABLE idempotency_records ADD COLUMN previous_state text;

-- Every row is inserted, updated once or twice, and deleted a day later, so
-- the table is all churn. Defaults assume the opposite:
-- * fillfactor 80 leaves a fifth of each page free, so Complete's update (it
--   changes no indexed column) can be a HOT update on the same page, with no
--   new index entries and less bloat;
-- * autovacuum by default waits for 20 % of the rows to be dead; on a table of
--   hundreds of millions of rows that is tens of millions of dead tuples before
--   the first pass. 2 % keeps vacuum frequent and each pass short;
-- * inserts alone trigger vacuum at 2 % too, keeping the visibility map fresh;
-- * a higher cost limit lets each pass finish instead of crawling behind the reaper.
ALTER TABLE idempotency_records SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_limit = 2000
);
