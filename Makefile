# The two commands of the README. Both start a throwaway Postgres when
# DATABASE_URL is not set (see scripts/with-postgres.sh).
.PHONY: run test

run:
	scripts/with-postgres.sh scripts/run.sh

test:
	PG_FSYNC=off scripts/with-postgres.sh scripts/test.sh

# The service against hand-written SQL (pgbench) on one throwaway Postgres with
# fsync on; BENCH_SECONDS, BENCH_REPEATS, BENCH_CONCURRENCY tune it (see the script).
.PHONY: bench
bench:
	scripts/bench.sh

# Where a new-key pair's time goes, hop by hop, at 1 and 16 callers, beside
# pgbench's pair, with the floors under every call (a Postgres round trip, a
# gRPC round trip to tonic alone, pgbench's pair behind tonic alone) and
# replays through Postgres (about six minutes after the build; not in CI). BUDGET_CONCURRENCY, BENCH_SECONDS, BUDGET_FLOOR_SECONDS
# tune it (see the script).
.PHONY: bench-budget
bench-budget:
	scripts/bench-budget.sh

# The server against the floor of a batching gRPC service (tonic and sqlx alone,
# one statement per batch RPC, in the ceiling's shape and in the server's), with
# pgbench's pair and the durable ceiling, at 16 and 256 callers (about six
# minutes after the build; not in CI). FLOOR_CONCURRENCY, FLOOR_ROUNDS,
# BENCH_SECONDS tune it (see the script).
.PHONY: bench-floor
bench-floor:
	scripts/bench-floor.sh

# What a streaming RPC would buy: a caller's batches as messages of one stream
# instead of one unary RPC each, against the floor and against the server with a
# measurement prototype applied to a scratch copy (bench/prototypes/; never
# merged), at 1 and 16 pairs in flight (about 15 minutes the first time, with its
# build; not in CI). STREAM_BATCHES, STREAM_CALLERS, STREAM_ROUNDS, BENCH_SECONDS tune it.
.PHONY: bench-stream
bench-stream:
	scripts/bench-stream.sh

# The client library's batches on its BatchStream against the same as batch
# RPCs, with pgbench beside them, at 1, 16 and 64 callers (about 8 minutes
# after the build; STREAM_CALLERS, STREAM_ROUNDS, BENCH_SECONDS tune it).
.PHONY: bench-client-stream
bench-client-stream:
	scripts/bench-client-stream.sh

# Cost as the table grows: new-key pairs with 0, 10 and 30 million live rows
# preloaded, and bytes per key on disk (about 25 GB of disk and an hour; not in
# CI). SCALE_ROWS, BENCH_SECONDS, BENCH_REPEATS tune it (see the script).
.PHONY: bench-scale
bench-scale:
	scripts/bench-scale.sh

# Cleanup under load: the reaper deleting a backlog of 5 million expired rows
# beside traffic at half the maximum rate, then a 20-minute soak with keys
# expiring as fast as they arrive (not in CI; see scripts/bench-scale.sh).
.PHONY: bench-reaper
bench-reaper:
	SCALE_PARTS="reaper soak" scripts/bench-scale.sh

# The server's peak memory under hostile input, many calls at once, against
# the chart's memory limit (release build, throwaway Postgres; see the script).
.PHONY: memory-check
memory-check:
	scripts/memory-check.sh

# The service through a Postgres failover and a planned switchover under load
# (etcd, Patroni with synchronous replication, HAProxy, PgBouncer; installed
# from Debian's packages when missing): nothing acknowledged may be lost.
# Also run by `make test`. See docs/operations.md, "Failover, tested".
.PHONY: test-ha
test-ha:
	scripts/test-ha.sh
