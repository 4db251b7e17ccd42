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
