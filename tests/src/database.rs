use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::{
    AssertSqlSafe, Connection, Executor, PgConnection, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};

/// A database of its own for one test, migrated, dropped when the test ends.
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
    admin_url: String,
    options: PgConnectOptions,
}

fn admin_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests with `make test`, which starts a throwaway Postgres",
    )
}

impl TestDb {
    pub async fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let admin_url = admin_url();
        let name = format!(
            "idempotency_test_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .expect("connecting to DATABASE_URL");
        admin
            .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("creating the test database");
        let options: PgConnectOptions = admin_url
            .parse::<PgConnectOptions>()
            .unwrap()
            .database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(options.clone())
            .await
            .expect("connecting to the test database");
        idempotency_server::db::migrate(&pool)
            .await
            .expect("migrating the test database");
        Self {
            pool,
            name,
            admin_url,
            options,
        }
    }

    /// The URL of this database, as the server's `--database-url` takes it.
    pub fn url(&self) -> url::Url {
        let mut url: url::Url = self.admin_url.parse().expect("DATABASE_URL is a URL");
        url.set_path(&self.name);
        url
    }

    /// Connection options for this database, e.g. to build the server's own pool.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// Rows in the records table: proof that a refused call wrote nothing.
    pub async fn row_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime, which cannot block on itself:
        // clean up from a thread with a runtime of its own.
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&admin_url).await {
                    let _ = admin
                        .execute(AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .await;
                }
            });
        })
        .join();
    }
}
