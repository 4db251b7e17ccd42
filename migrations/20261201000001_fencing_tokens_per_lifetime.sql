-- The fencing token that starts a record's lifetime (a new record, or the
-- takeover of an expired one): the database clock in microseconds, times 1024.
-- Takeovers within the lifetime add one, as before. The clock is read when the
-- row is written (clock_timestamp()), not when the statement began (now()): a
-- batched Acquire may wait seconds on another key's insert before it writes
-- this key, and meanwhile a whole lifetime of this key may begin and be purged.
--
-- Tokens used to start again at 1 with every lifetime. A holder that overran
-- its lease on a record whose TTL was no longer than the lease (so the record
-- expired with the lease) then held the same token as the next, unrelated
-- attempt, and its Complete was accepted over that attempt's.
--
-- A new lifetime starts at least a second after the previous one began (the
-- shortest TTL), or, after an operator's purge, in a later transaction: its
-- first token is larger than every token of the earlier lifetime unless that
-- one saw 1024 takeovers per microsecond between the two (a takeover needs a
-- lapsed lease of a second or more, or a retryable Fail). So a key's tokens
-- only grow, unless the database's clock steps back by more than the gap
-- between two lifetimes; leases rely on that clock already. Tokens fit a
-- bigint until the year 2255.
--
-- A function, not a sequence: it is inlined into the statements and writes
-- nothing, so an Acquire of an existing key still commits without a WAL flush
-- (a sequence draws for every row of the insert, existing keys included, and
-- writes WAL every 32 draws). Rows written by older servers keep their small
-- tokens; once no older server runs (they still start lifetimes at 1 during a
-- rolling upgrade), every new lifetime starts above them.
CREATE FUNCTION idempotency_lifetime_token() RETURNS bigint
    LANGUAGE sql VOLATILE PARALLEL SAFE
    AS $$ SELECT floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint * 1024 $$;
