//! The real `idempotencyd` binary in a process of its own, its stdout (the
//! log) collected line by line: for what only the binary does, such as how
//! its log lines look.
//!
//! A test crate cannot ask cargo for another package's binary
//! (`CARGO_BIN_EXE_*` names only its own), so the binary is built here as
//! `scripts/smoke-cli.sh` builds it (same features as the test build, so the
//! two share their compiled crates; a no-op when it is up to date) and
//! found beside the test executable's `deps/` directory.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

/// The `idempotencyd` binary, built once per test process.
pub fn idempotencyd() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
            let status = Command::new(cargo)
                .current_dir(&workspace)
                .args(["build", "--locked", "--workspace", "--all-features"])
                .args(["--bin", "idempotencyd"])
                .status()
                .expect("running cargo build");
            assert!(status.success(), "building idempotencyd failed");
            // target/<profile>/deps/<test binary> -> target/<profile>/idempotencyd
            let test_binary = std::env::current_exe().expect("the test's executable");
            let profile_dir = test_binary
                .parent()
                .and_then(|deps| deps.parent())
                .expect("the test runs from target/<profile>/deps");
            let binary = profile_dir.join("idempotencyd");
            assert!(binary.exists(), "no {}", binary.display());
            binary
        })
        .clone()
}

/// `idempotencyd serve` running, JSON logs collected.
pub struct ServerProcess {
    pub addr: SocketAddr,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Serves `database_url` on a free loopback port with JSON logs and
    /// `flags` besides; returns once it listens.
    pub async fn start(database_url: &str, flags: &[&str]) -> Self {
        let mut child = Command::new(idempotencyd())
            .arg("serve")
            .args([
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(["--log-format", "json", "--reaper-enabled", "false"])
            .args(flags)
            .env_clear()
            .env("DATABASE_URL", database_url)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting idempotencyd");
        let stdout = child.stdout.take().expect("piped stdout");
        let lines = Arc::<Mutex<Vec<String>>>::default();
        let collected = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                collected.lock().unwrap().push(line);
            }
        });
        let mut server = Self {
            addr: "127.0.0.1:0".parse().unwrap(),
            child,
            lines,
        };
        let announced = server
            .wait_for_line(|line| {
                line["message"]
                    .as_str()
                    .is_some_and(|message| message.starts_with("serving gRPC"))
            })
            .await;
        server.addr = announced["addr"]
            .as_str()
            .expect("the announcement names the address")
            .parse()
            .unwrap();
        server
    }

    /// Every log line so far, parsed.
    pub fn lines(&self) -> Vec<serde_json::Value> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|_| panic!("a JSON line: {line}"))
            })
            .collect()
    }

    /// The raw log lines so far.
    pub fn raw_lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits (up to 30 s) for a log line that `matches`, and returns it.
    pub async fn wait_for_line(
        &mut self,
        matches: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        for _ in 0..600 {
            if let Some(line) = self.lines().into_iter().find(|line| matches(line)) {
                return line;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("idempotencyd exited ({status}): {:#?}", self.raw_lines());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("no such log line: {:#?}", self.raw_lines());
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
