-- The durable ceiling: the new-key pair's insert and update (new_key_pair.sql)
-- written by hand as multi-row statements of :keys keys each (32 in make
-- bench): two autocommit statements, two commits and WAL flushes per :keys
-- keys, the most this Postgres does with these rows at this durability.
--
-- The keys are laid out in the index as the load generator's are (and a
-- batching service's, whose statement holds the keys of many callers): a
-- region of their own per run (pgbench's :random_seed, a new one per run),
-- in it a region per client and statement row (client_id, i: 8 x 32 = 256,
-- as the load generator's 256 callers each have one), and in that a random
-- place per statement (:r). So a statement's keys land on 32 leaf pages of
-- the primary key, not on one: before 2026-12-06 they were adjacent
-- ('c-<client>-<r>-<i>', kept as ceiling_pair_adjacent.sql), which took
-- about a tenth less Postgres work per key than the rows the service
-- writes (docs/performance.md, "The ceiling's keys").
--
-- Run with: pgbench -M prepared -n -f ceiling_pair.sql -D payload=256 -D keys=32 ...
-- keys/s = transactions/s x :keys. (The UPDATE's keys are an array, `= ANY`,
-- so that its prepared plan is an index scan whatever :keys is: with `IN
-- (SELECT ...)` the generic plan expects 1,000 rows and scans the table.)
\set r random(1, 1000000000000000)
INSERT INTO idempotency_records
    (namespace, operation, subject, key, state, fingerprint, fencing_token,
     created_at, expires_at, lease_expires_at)
SELECT 'bench', 'POST /bench', 'pgbench', 'c-' || :random_seed || '-' || :client_id || '-' || i || '-' || :r, 'in_progress',
       '\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea, 1,
       now(), now() + interval '24 hours', now() + interval '60 seconds'
FROM generate_series(1, :keys) AS i
ON CONFLICT DO NOTHING
RETURNING fencing_token;
UPDATE idempotency_records
SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
    response_status = 201, response_body = convert_to(repeat('x', :payload), 'UTF8'),
    response_headers = '{}'
WHERE namespace = 'bench' AND operation = 'POST /bench' AND subject = 'pgbench'
  AND key = ANY (ARRAY(SELECT 'c-' || :random_seed || '-' || :client_id || '-' || i || '-' || :r
                       FROM generate_series(1, :keys) AS i))
  AND fencing_token = 1;
