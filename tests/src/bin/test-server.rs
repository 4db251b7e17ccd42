//! The real server in a process of its own, for tests that signal it (a
//! SIGSTOP pauses a whole process, which an in-process server cannot show)
//! or run several servers as replicas on one database (in processes of
//! their own, they share nothing but Postgres).
//!
//! Serves the test settings ([`idempotency_tests::settings_for`]), with its
//! arguments as further flags of `idempotencyd serve`, on free loopback
//! ports, on the database named by `IDEMPOTENCY_TEST_DATABASE` in the
//! cluster of `DATABASE_URL`; prints the gRPC address on a line of its own,
//! then the /metrics address on the next, and serves until killed.

use std::io::Write;

use idempotency_server::startup::Application;
use idempotency_tests::settings_with_flags;

#[tokio::main]
async fn main() {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let database = std::env::var("IDEMPOTENCY_TEST_DATABASE").expect("IDEMPOTENCY_TEST_DATABASE");
    let mut url: url::Url = url.parse().expect("DATABASE_URL");
    url.set_path(&database);
    let flags: Vec<String> = std::env::args().skip(1).collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let app = Application::build(settings_with_flags(url.as_str(), &flags))
        .await
        .expect("building");
    // Both lines in one write: a reader that wants only the first may
    // close the pipe as soon as it has it.
    let announcement = format!("{}\n{}\n", app.grpc_addr(), app.metrics_addr());
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(announcement.as_bytes()).expect("stdout");
    stdout.flush().expect("stdout");
    drop(stdout);
    app.run_until_stopped(std::future::pending())
        .await
        .expect("serving");
}
