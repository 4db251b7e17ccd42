//! Servers as a deployment runs them: one, or several replicas on one
//! database, for the tests whose guarantee must hold across replicas (one
//! holder per key, fencing, the replay cache's bound after a purge).
//!
//! One replica is the in-process [`TestServer`], as `spawn_app` starts it.
//! Two or more each run in a process of their own (the `test-server`
//! binary, the same settings), so they share nothing but Postgres: not the
//! engine, the replay cache, the statement batchers, the pool or the
//! metrics. (`idempotency_tests::process::ServerProcess` runs the real
//! `idempotencyd` binary, but builds it with cargo from inside the test,
//! which waits on other builds; `test-server` is built with the tests.)

use std::{
    io::BufRead,
    net::SocketAddr,
    process::{Child, Command, Stdio},
};

use idempotency_tests::{TestDb, TestServer, settings_with_flags};

use crate::support::Client;

/// A server the test started, stopped when dropped.
enum Server {
    InProcess { _server: Box<TestServer> },
    Process(Child),
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Server::Process(child) = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `count` servers on one fresh database.
pub struct Replicas {
    /// Each replica's gRPC and /metrics addresses.
    addrs: Vec<(SocketAddr, SocketAddr)>,
    _servers: Vec<Server>,
    /// Declared last, so dropped last: the servers let go of it first.
    pub db: TestDb,
}

impl Replicas {
    /// `count` servers with the test settings and `flags` (of
    /// `idempotencyd serve`, not already among the test settings).
    pub async fn start(count: usize, flags: &[&str]) -> Self {
        assert!(count > 0, "at least one replica");
        let db = TestDb::new().await;
        let mut servers = Vec::with_capacity(count);
        let mut addrs = Vec::with_capacity(count);
        if count == 1 {
            let server =
                TestServer::start_with(settings_with_flags(db.url().as_str(), flags)).await;
            addrs.push((server.addr, server.metrics_addr));
            servers.push(Server::InProcess {
                _server: Box::new(server),
            });
        } else {
            for _ in 0..count {
                let (server, announced) = start_process(&db, flags).await;
                addrs.push(announced);
                servers.push(server);
            }
        }
        Self {
            addrs,
            _servers: servers,
            db,
        }
    }

    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    /// A client of `replica` on a connection of its own.
    pub async fn client(&self, replica: usize) -> Client {
        Client::new(TestServer::channel_to(self.addrs[replica].0).await)
    }

    /// One client of every replica, in the replicas' order.
    pub async fn each(&self) -> Vec<Client> {
        self.clients(self.len()).await
    }

    /// `connections` clients, each on a connection of its own, spread over
    /// the replicas in turn: client `i` calls replica `i % len()`.
    pub async fn clients(&self, connections: usize) -> Vec<Client> {
        let mut clients = Vec::with_capacity(connections);
        for i in 0..connections {
            clients.push(self.client(i % self.len()).await);
        }
        clients
    }

    /// `replica`'s /metrics page.
    pub async fn metrics(&self, replica: usize) -> String {
        idempotency_tests::http_get(self.addrs[replica].1, "/metrics").await
    }
}

/// Starts `test-server` on `db` with `flags`; returns it and its gRPC and
/// /metrics addresses once it listens (bounded: it prints them once bound,
/// or exits and closes its output).
async fn start_process(db: &TestDb, flags: &[&str]) -> (Server, (SocketAddr, SocketAddr)) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_test-server"))
        .args(flags)
        .env("IDEMPOTENCY_TEST_DATABASE", &db.name)
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting test-server");
    let stdout = child.stdout.take().expect("piped stdout");
    // Killed on drop from here on, also when it never announces itself.
    let server = Server::Process(child);
    let read = tokio::task::spawn_blocking(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        let mut addr = || -> SocketAddr {
            let line = lines.next().expect("test-server exited").unwrap();
            line.trim()
                .parse()
                .expect("test-server prints its addresses")
        };
        (addr(), addr())
    });
    let announced = tokio::time::timeout(std::time::Duration::from_secs(60), read)
        .await
        .expect("test-server listens within a minute")
        .expect("reading test-server's addresses");
    (server, announced)
}
