# The two commands of the README. Both start a throwaway Postgres when
# DATABASE_URL is not set (see scripts/with-postgres.sh).
.PHONY: run test

run:
	scripts/with-postgres.sh scripts/run.sh

test:
	PG_FSYNC=off scripts/with-postgres.sh scripts/test.sh
