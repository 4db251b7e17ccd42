//! The real server in a process of its own, for tests that signal it (a
//! SIGSTOP pauses a whole process, which an in-process server cannot show).
//!
//! Serves the test settings ([`idempotency_tests::settings_for`]) on a free
//! loopback port, on the database named by `IDEMPOTENCY_TEST_DATABASE` in the
//! cluster of `DATABASE_URL`, prints the gRPC address on a line of its own,
//! and serves until killed.

use std::io::Write;

use idempotency_server::startup::Application;
use idempotency_tests::settings_for;

#[tokio::main]
async fn main() {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let database = std::env::var("IDEMPOTENCY_TEST_DATABASE").expect("IDEMPOTENCY_TEST_DATABASE");
    let mut url: url::Url = url.parse().expect("DATABASE_URL");
    url.set_path(&database);
    let app = Application::build(settings_for(url.as_str()))
        .await
        .expect("building");
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{}", app.grpc_addr()).expect("stdout");
    stdout.flush().expect("stdout");
    app.run_until_stopped(std::future::pending())
        .await
        .expect("serving");
}
