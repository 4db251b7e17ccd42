//! The real server in a process of its own, for tests that signal it (a
//! SIGSTOP pauses a whole process, which an in-process server cannot show).
//!
//! Serves the test settings ([`idempotency_tests::test_config`]) on a free
//! loopback port, on the database named by `IDEMPOTENCY_TEST_DATABASE` in the
//! cluster of `DATABASE_URL`, prints the gRPC address on a line of its own,
//! and serves until killed.

use std::io::Write;

use idempotency_server::startup::Application;
use idempotency_tests::{server_pool, test_config};
use sqlx::postgres::PgConnectOptions;

#[tokio::main]
async fn main() {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let database = std::env::var("IDEMPOTENCY_TEST_DATABASE").expect("IDEMPOTENCY_TEST_DATABASE");
    let options = url
        .parse::<PgConnectOptions>()
        .expect("DATABASE_URL")
        .database(&database);
    let app = Application::build(test_config(), server_pool(options))
        .await
        .expect("binding");
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{}", app.grpc_addr()).expect("stdout");
    stdout.flush().expect("stdout");
    app.run_until_stopped(std::future::pending())
        .await
        .expect("serving");
}
