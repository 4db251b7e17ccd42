//! `TEST_LOG=1`: the server's log (tracing) in the test's output, which
//! nextest shows for a failing test. Without it the tests are quiet.
//! `RUST_LOG` picks what is logged (default `info`), as for the server's
//! `--log-level`.

use std::sync::Once;

use tracing_subscriber::EnvFilter;

/// Installs the test log when `TEST_LOG` asks for it (set, and neither empty
/// nor `0`); once per process, however many servers the test starts.
pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        if !matches!(std::env::var("TEST_LOG").as_deref(), Ok(value) if !value.is_empty() && value != "0")
        {
            return;
        }
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
        // The test writer prints through the test harness's capture, so the
        // lines land in the failing test's output, not on the terminal.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_target(true)
            .with_test_writer()
            .try_init();
    });
}
