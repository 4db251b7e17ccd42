-- The service's own batch statements for :keys new keys, as one of its
-- batch workers runs them at high load: the Acquire statement
-- (`insert_or_read` in server/src/store/statements.rs) for :keys keys, then
-- the Complete statement (`finish`) for the same keys. Run beside
-- ceiling_pair.sql (the same rows written by hand as two multi-row
-- statements), it shows what the statements' shape costs in Postgres
-- alone, with no gRPC, server or load generator on the machine
-- (docs/performance.md, "The statements alone against the ceiling").
-- The server binds each column as an array; here pgbench builds the arrays.
-- One difference: pgbench cannot carry the tokens the Acquire returned to
-- the Complete, so the Complete's arrays hold token 0 and its condition
-- reads `r.fencing_token <> v.token` where the server's reads `=` (the
-- same cost, on the same row). Kept in step with the server's
-- statements by a test in statements.rs. The keys are laid out in the index
-- as ceiling_pair.sql's (a region per run, then per client and row).
--
-- Run with: PGOPTIONS="-c enable_seqscan=off -c enable_bitmapscan=off -c jit=off"
--   pgbench -M prepared -n -f service_batch_pair.sql -D payload=256 -D keys=64 -c 2 ...
-- (the serving pool's settings); keys/s = transactions/s x :keys.
\set r random(1, 1000000000000000)
WITH input AS (
    SELECT * FROM unnest(array_fill('bench'::text, ARRAY[:keys::int]), array_fill('POST /bench'::text, ARRAY[:keys::int]), array_fill('pgbench'::text, ARRAY[:keys::int]),
                         ARRAY(SELECT 's-' || :random_seed::text || '-' || :client_id::text || '-' || i || '-' || :r::text FROM generate_series(1, :keys::int) i),
                         array_fill('\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea, ARRAY[:keys::int]),
                         array_fill('24 hours'::interval, ARRAY[:keys::int]), array_fill('60 s'::interval, ARRAY[:keys::int]))
        WITH ORDINALITY AS v(namespace, operation, subject, key, fingerprint, ttl, lease, ord)
    WHERE set_config('lock_timeout', coalesce('100ms', current_setting('lock_timeout')), true)
          IS NOT NULL
), inserted AS (
    INSERT INTO idempotency_records
        (namespace, operation, subject, key, state, fingerprint, fencing_token,
         created_at, expires_at, lease_expires_at)
    SELECT namespace, operation, subject, key, 'in_progress', fingerprint,
           idempotency_lifetime_token(),
           now(), now() + greatest(ttl, lease), now() + lease
    FROM input
    ORDER BY ord
    ON CONFLICT (namespace, operation, subject, key) DO NOTHING
    RETURNING namespace, operation, subject, key, state, fingerprint, fencing_token,
              created_at, expires_at, lease_expires_at, completed_at,
              response_status, response_body, response_headers
)
SELECT i.ord, true AS inserted, x.state, x.fingerprint, x.fencing_token, x.created_at,
       x.expires_at, x.lease_expires_at, x.completed_at, x.response_status,
       x.response_body, x.response_headers, now() AS db_now
FROM input i JOIN inserted x USING (namespace, operation, subject, key)
UNION ALL
SELECT i.ord, false, r.state, r.fingerprint, r.fencing_token, r.created_at,
       r.expires_at, r.lease_expires_at, r.completed_at, r.response_status,
       r.response_body, r.response_headers, now()
FROM input i JOIN idempotency_records r USING (namespace, operation, subject, key)
WHERE NOT EXISTS (SELECT 1 FROM inserted x
                  WHERE (x.namespace, x.operation, x.subject, x.key)
                      = (i.namespace, i.operation, i.subject, i.key));
WITH v AS (
    SELECT * FROM unnest(array_fill('bench'::text, ARRAY[:keys::int]), array_fill('POST /bench'::text, ARRAY[:keys::int]), array_fill('pgbench'::text, ARRAY[:keys::int]),
                         ARRAY(SELECT 's-' || :random_seed::text || '-' || :client_id::text || '-' || i || '-' || :r::text FROM generate_series(1, :keys::int) i),
                         array_fill(0::int8, ARRAY[:keys::int]),
                         array_fill('completed'::text, ARRAY[:keys::int]), array_fill(201, ARRAY[:keys::int]),
                         array_fill(convert_to(repeat('x', :payload::int), 'UTF8'), ARRAY[:keys::int]), array_fill('{}'::jsonb, ARRAY[:keys::int]))
        WITH ORDINALITY
        AS v(namespace, operation, subject, key, token, state, status, body, headers, ord)
    WHERE set_config('lock_timeout', coalesce('100ms', current_setting('lock_timeout')), true)
          IS NOT NULL
)
UPDATE idempotency_records AS r
SET state = v.state, lease_expires_at = NULL, completed_at = now(),
    response_status = v.status, response_body = v.body, response_headers = v.headers
FROM v
WHERE r.namespace = v.namespace AND r.operation = v.operation
  AND r.subject = v.subject AND r.key = v.key
  AND r.fencing_token <> v.token AND r.state = 'in_progress'
  AND (r.expires_at > now()) IS TRUE
RETURNING v.ord, r.completed_at;
