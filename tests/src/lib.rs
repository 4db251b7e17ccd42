//! Harness for the end-to-end tests: a fresh database per test, the real
//! server on `127.0.0.1:0`, the generated client ([`spawn_app`] makes the
//! three), and a TCP proxy that can cut the server off from Postgres.
//! `TEST_LOG=1` prints the server's log in the test's output.

mod database;
pub mod grpc_app;
pub mod http_app;
pub mod process;
mod proxy;
pub mod raw;
pub mod security;
mod server;
pub mod stream;
mod test_log;

pub use database::TestDb;
pub use proxy::TcpProxy;
pub use server::{
    TestApp, TestServer, server_pool, settings_for, settings_with_flags, spawn_app, spawn_app_with,
    test_settings,
};

use std::sync::atomic::{AtomicU64, Ordering};

use idempotency_client::pb;

/// A key no other test uses, 8+ printable ASCII characters.
pub fn unique_key(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{label}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// An id in the `payments` namespace for `POST /payments` on behalf of `user-1`.
pub fn record_id(key: &str) -> pb::RecordId {
    pb::RecordId {
        namespace: "payments".into(),
        operation: "POST /payments".into(),
        subject: "user-1".into(),
        key: key.into(),
    }
}

pub fn seconds(seconds: i64) -> prost_types::Duration {
    prost_types::Duration { seconds, nanos: 0 }
}

/// A response as an HTTP service would store it.
pub fn response(status_code: u32, body: &str) -> pb::StoredResponse {
    pb::StoredResponse {
        status_code,
        body: body.as_bytes().to_vec(),
        headers: [
            ("content-type".to_string(), "application/json".to_string()),
            ("location".to_string(), "/payments/42".to_string()),
        ]
        .into(),
    }
}

/// Inserts `count` records straight into the table, expired `expired_seconds_ago`
/// (negative: expiring in the future), completed, in namespace `namespace`.
pub async fn insert_records(
    pool: &sqlx::PgPool,
    namespace: &str,
    count: i64,
    expired_seconds_ago: i64,
) {
    sqlx::query(
        "INSERT INTO idempotency_records
             (namespace, operation, subject, key, state, fingerprint, fencing_token,
              created_at, expires_at, completed_at, response_status, response_body, response_headers)
         SELECT $1, 'POST /bulk', '', 'bulk-key-' || n, 'completed', '', 1,
                now() - interval '1 day', now() - make_interval(secs => $3), now(), 201, '', '{}'
         FROM generate_series(1, $2) AS n",
    )
    .bind(namespace)
    .bind(count)
    .bind(expired_seconds_ago as f64)
    .execute(pool)
    .await
    .expect("inserting records");
}

/// Fetches `path` from `addr` over plain HTTP/1.0 and returns the whole answer.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}

/// The value of the sample `series` (name with labels, as rendered) in a /metrics page.
pub fn metric_value(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|line| {
        line.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// A server whose database connections go through a [`TcpProxy`], so a test
/// can cut it off from Postgres and restore it.
pub async fn server_behind_proxy(db: &TestDb) -> (TestServer, TcpProxy) {
    server_behind_proxy_with(db, test_settings(db)).await
}

/// [`server_behind_proxy`] with settings of the test's own (their database
/// URL is replaced by the proxy's).
pub async fn server_behind_proxy_with(
    db: &TestDb,
    mut settings: idempotency_server::settings::Settings,
) -> (TestServer, TcpProxy) {
    let mut url = db.url();
    let upstream = tokio::net::lookup_host((
        url.host_str().expect("DATABASE_URL names a host"),
        url.port().unwrap_or(5432),
    ))
    .await
    .unwrap()
    .next()
    .unwrap();
    let proxy = TcpProxy::start(upstream).await;
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(proxy.addr.port())).unwrap();
    settings.database.database_url = Some(database_url(&url));
    (TestServer::start_with(settings).await, proxy)
}

/// `url` as the server's settings hold it.
pub fn database_url(url: &url::Url) -> idempotency_server::settings::DatabaseUrl {
    url.as_str().parse().expect("a test database URL")
}

/// Locks a record's row in a transaction of the test's own, so that the
/// server's next statement on it waits until the transaction ends.
pub async fn lock_record(db: &TestDb, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_records WHERE key = $1 FOR UPDATE")
        .bind(key)
        .execute(&mut *blocker)
        .await
        .unwrap();
    blocker
}

/// A test transaction's uncommitted write of `key`'s row: an insert of that
/// key waits for it to end (a row lock alone would not make it wait).
pub async fn hold_write(db: &TestDb, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut writer = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE idempotency_records SET fencing_token = fencing_token WHERE key = $1")
        .bind(key)
        .execute(&mut *writer)
        .await
        .unwrap();
    writer
}

/// How many sessions of `db` wait on a lock now.
pub async fn lock_waiters(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
    )
    .bind(&db.name)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Waits until a statement in `db` waits on a row lock.
pub async fn wait_for_lock_wait(db: &TestDb) {
    for _ in 0..100 {
        if lock_waiters(db).await > 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("no statement ever waited on the lock");
}

/// Asserts the status's code and its `ErrorInfo` reason.
#[track_caller]
pub fn assert_error(
    result: Result<impl std::fmt::Debug, tonic::Status>,
    code: tonic::Code,
    reason: &str,
) -> tonic::Status {
    let status = result.expect_err("the call should fail");
    assert_eq!(status.code(), code, "{status:?}");
    let info =
        tonic_types::StatusExt::get_details_error_info(&status).expect("an ErrorInfo detail");
    assert_eq!(info.reason, reason, "{status:?}");
    assert_eq!(info.domain, "idempotency");
    status
}

/// Runs `future` with its log events captured as JSON (one object per
/// event); the future must run on this thread (a current-thread test).
pub async fn capture_logs<F: std::future::Future>(
    future: F,
) -> (F::Output, Vec<serde_json::Value>) {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::util::SubscriberInitExt;

    #[derive(Clone)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    let buffer = Buffer(Arc::default());
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_target(true)
        .with_writer(move || writer.clone())
        .finish();
    let output = {
        let _guard = subscriber.set_default();
        future.await
    };
    let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
    let events = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    (output, events)
}
