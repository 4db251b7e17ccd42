//! The connection pool and migrations.

use std::time::Duration;

use sqlx::{
    PgPool,
    migrate::Migrator,
    postgres::{PgConnectOptions, PgPoolOptions},
};

/// The SQL in `migrations/`, embedded at build time.
/// Migrations a binary does not know are allowed in the database: during a
/// rolling upgrade, and after a rollback, older binaries serve a schema that
/// newer ones migrated (every migration keeps the schema readable and
/// writable by the release before it; docs/operations.md).
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../migrations")
};

/// Statement timeout of a migration run, whatever the serving timeout: a
/// migration may rewrite the table, and waits for another pod's run to end.
pub const MIGRATION_STATEMENT_TIMEOUT: Duration = Duration::from_secs(600);

/// How the server uses its connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSettings {
    pub max_connections: u32,
    /// How long a call waits for a free connection before it is answered UNAVAILABLE.
    pub acquire_timeout: Duration,
    /// Longest a single statement may run (Postgres `statement_timeout`).
    pub statement_timeout: Duration,
    /// Plan every statement as index lookups (`enable_seqscan` and
    /// `enable_bitmapscan` off for the session). The service's statements
    /// are all key or `expires_at` lookups, but a plan made while the table
    /// is new and nearly empty scans it whole, and a prepared statement
    /// keeps that plan until the next ANALYZE, while the table grows. (The
    /// gauges' exact row count of a small table still scans it: no index
    /// can answer it.) Prepared statements use their generic plan from the
    /// first run (`plan_cache_mode`). Off for migrations and the admin CLI,
    /// which may read whole tables on purpose.
    pub index_lookups_only: bool,
}

/// The flags' defaults (`settings.rs`'s tests keep the two equal).
impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(5),
            index_lookups_only: true,
        }
    }
}

/// The `application_name` of the server's connections, unless the database
/// URL names another.
pub const APPLICATION_NAME: &str = "idempotencyd";

/// Builds the pool without connecting, so the server starts (NOT_SERVING)
/// while the database is still coming up and recovers when it arrives.
pub fn pool(options: PgConnectOptions, settings: &PoolSettings) -> PgPool {
    // Named, so that operators can tell the service's connections apart in
    // pg_stat_activity (a name in DATABASE_URL wins).
    let options = match options.get_application_name() {
        Some(_) => options,
        None => options.application_name(APPLICATION_NAME),
    };
    // Every statement is bounded, so a stuck query becomes UNAVAILABLE, not a hung call.
    let mut options = options.options([(
        "statement_timeout",
        format!("{}ms", settings.statement_timeout.as_millis()),
    )]);
    if settings.index_lookups_only {
        // JIT off too: a query that must scan anyway (the small-table row
        // count behind the gauges) carries the planner's huge penalty cost,
        // which would otherwise trigger JIT compilation on every run.
        //
        // Generic plans from the first run: with Postgres's default
        // (`auto`), the batched Complete was planned anew on every call,
        // about 0.25 ms each, because the planner costs one row of its
        // arrays (known in a custom plan) below the ten it assumes in a
        // generic one. The guards above are what keep generic plans on the
        // indexes (`store` module docs on plans).
        options = options.options([
            ("enable_seqscan", "off"),
            ("enable_bitmapscan", "off"),
            ("jit", "off"),
            ("plan_cache_mode", "force_generic_plan"),
        ]);
    }
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        // A ping before every checkout would double the round trips of the
        // hot path; a dead connection fails its query instead (UNAVAILABLE,
        // which clients retry) and is then discarded.
        .test_before_acquire(false)
        .idle_timeout(Duration::from_secs(300))
        .connect_lazy_with(options)
}

/// The `statement_timeout` that [`pool`] gave `options` (the last one set
/// wins, as in Postgres), so that the store can bound each statement on its
/// own side too: Postgres' timeout never fires when the database stops
/// answering altogether. `None` when none is set or it is not in the
/// milliseconds [`pool`] writes.
pub fn statement_timeout(options: &PgConnectOptions) -> Option<Duration> {
    let value = options
        .get_options()?
        .rsplit("-c ")
        .find_map(|option| option.trim().strip_prefix("statement_timeout="))?;
    let millis = value.strip_suffix("ms")?.parse().ok()?;
    Some(Duration::from_millis(millis))
}

pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every migration a release shipped, in order. With `ignore_missing` the
    /// database no longer catches a migration file deleted or renamed in this
    /// binary (a renamed one would run again), so this list does: append to
    /// it, never edit it.
    const SHIPPED: &[(i64, &str)] = &[
        (20261130000001, "create idempotency records"),
        (20261130000002, "tune records for churn"),
        (20261201000001, "fencing tokens per lifetime"),
    ];

    #[test]
    fn no_shipped_migration_is_lost_or_renamed() {
        let here: Vec<(i64, &str)> = MIGRATOR
            .iter()
            .map(|migration| (migration.version, migration.description.as_ref()))
            .collect();
        assert_eq!(&here[..SHIPPED.len().min(here.len())], SHIPPED);
    }

    #[tokio::test]
    async fn the_statement_timeout_is_read_back_from_the_pool() {
        let settings = PoolSettings {
            statement_timeout: Duration::from_millis(1500),
            ..PoolSettings::default()
        };
        let options: PgConnectOptions = "postgres://u@localhost/db".parse().unwrap();
        let pool = pool(options.clone(), &settings);

        assert_eq!(
            statement_timeout(&pool.connect_options()),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(statement_timeout(&options), None);
        let later = options
            .options([("statement_timeout", "1ms")])
            .options([("statement_timeout", "250ms"), ("jit", "off")]);
        assert_eq!(statement_timeout(&later), Some(Duration::from_millis(250)));
    }

    #[tokio::test]
    async fn connections_are_named_unless_the_url_names_them() {
        let settings = PoolSettings::default();
        let unnamed = pool("postgres://u@localhost/db".parse().unwrap(), &settings);
        let named = pool(
            "postgres://u@localhost/db?application_name=mine"
                .parse()
                .unwrap(),
            &settings,
        );

        assert_eq!(
            unnamed.connect_options().get_application_name(),
            Some(APPLICATION_NAME)
        );
        assert_eq!(named.connect_options().get_application_name(), Some("mine"));
    }
}
