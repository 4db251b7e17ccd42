-- A replay as a lone Acquire reads it first: the read-first statement of
-- server/src/store/statements.rs (`READ_FIRST_ONE`) for one completed key,
-- its parameters as pgbench variables (with -M prepared, pgbench binds each
-- as a parameter, as the server does). Beside replay.sql (the plain SELECT
-- a lone Acquire runs once most of its keys exist, and Get runs) it shows
-- what the read-first statement costs in Postgres. A test keeps it in step
-- with the server's (`the_pgbench_copy_of_the_read_first_statement_matches_it`).
--
-- Run with: pgbench -M prepared -n -f read_first_replay.sql -D keys=1000
--   -D ns=bench -D "op=POST /bench" -D sub=pgbench -D "ttl=24 hours"
--   -D "lease=60 s" -D wait=100ms -D 'fp=\x00' ...
-- (the keys of replay.sql, 'replay-1' .. 'replay-<keys>', stored beforehand).
\set k random(1, :keys)
WITH existing AS (
    SELECT state, fingerprint, fencing_token, created_at, expires_at, lease_expires_at,
           completed_at, response_status, response_body, response_headers
    FROM idempotency_records
    WHERE namespace = :ns AND operation = :op AND subject = :sub AND key = 'replay-' || :k
), inserted AS (
    INSERT INTO idempotency_records
        (namespace, operation, subject, key, state, fingerprint, fencing_token,
         created_at, expires_at, lease_expires_at)
    SELECT :ns, :op, :sub, 'replay-' || :k, 'in_progress', :fp, idempotency_lifetime_token(),
           now(), now() + greatest(:ttl::interval, :lease::interval), now() + :lease::interval
    WHERE NOT EXISTS (SELECT 1 FROM existing)
      AND set_config('lock_timeout', coalesce(:wait, current_setting('lock_timeout')), true)
          IS NOT NULL
    ON CONFLICT (namespace, operation, subject, key) DO NOTHING
    RETURNING state, fingerprint, fencing_token, created_at, expires_at, lease_expires_at,
              completed_at, response_status, response_body, response_headers
)
SELECT 1::int8 AS ord, true AS inserted, *, now() AS db_now FROM inserted
UNION ALL
SELECT 1, false, *, now() FROM existing;
