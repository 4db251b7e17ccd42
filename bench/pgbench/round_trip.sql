-- One round trip to Postgres with nothing behind it: the floor under every
-- statement (scripts/bench-budget.sh).
SELECT 1;
