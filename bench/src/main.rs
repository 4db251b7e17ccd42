//! `idempotency-bench`: a bounded load generator for the idempotency service.
//!
//! Scenarios:
//! - `new-keys`: Acquire a fresh (random) key, then Complete it (one "pair" per operation);
//! - `replay`: Acquire keys completed beforehand (round-robin), expecting a replay;
//! - `contention`: many callers on a few hot keys; the winner completes;
//! - `mixed`: new keys and replays by `--mix`;
//! - `health`: one `grpc.health.v1.Health/Check` per operation, answered
//!   from memory: a gRPC round trip with no engine and no database behind it.
//!
//! `--serve-health ADDR` serves that health service alone, with tonic's
//! defaults and none of the server's layers: against it, `--scenario health`
//! measures what a gRPC round trip costs on this machine at all, the floor
//! under every call of the service (`make bench-budget` prints both).
//!
//! Every call is made once (no retries), so errors are counted, not hidden.
//! It stops by itself after `--duration` or `--count` operations.
//!
//! By default the callers go as fast as their answers come back (a closed
//! loop); `--rate` paces them to a steady rate instead, as for the reaper's
//! measurement at half the maximum rate (`scripts/bench-scale.sh`). There,
//! `--uuid-keys` and `--subjects` spread new keys over the whole primary key
//! index, as the keys of many users do, and `--ttl` makes them expire.
//!
//! With `--tls-ca` it connects over TLS (an `https://` endpoint), with
//! `--bearer-token-file` it sends a bearer token on every RPC, as a caller
//! in Kubernetes does; `--make-auth-files DIR` writes the certificates,
//! keys, tokens and policy for a server to match ([`auth_files`]).

mod auth_files;
mod driver;
mod floor;
mod stats;
mod steps;

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use idempotency_client::pb::{self, idempotency_service_client::IdempotencyServiceClient};
use idempotency_client::{
    AcquireRequest, Acquisition, Batching, Client, Error, RecordId, RetryPolicy, StoredResponse,
    TlsFiles, TokenSource,
};
use serde_json::json;
use stats::{
    Recorder, Stats, busy_fraction, machine_cpu_ticks, percentiles, percentiles_line,
    process_cpu_seconds,
};
use steps::StepStream;
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// Acquire a fresh key, then Complete it.
    NewKeys,
    /// Acquire keys completed beforehand, expecting a replay.
    Replay,
    /// Many callers on a few hot keys.
    Contention,
    /// New keys and replays by --mix.
    Mixed,
    /// A `grpc.health.v1.Health/Check` per operation (no engine, no database).
    Health,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::NewKeys => "new-keys",
            Scenario::Replay => "replay",
            Scenario::Contention => "contention",
            Scenario::Mixed => "mixed",
            Scenario::Health => "health",
        }
    }
}

/// `new:replay` weights, e.g. `80:20`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mix {
    new: u32,
    replay: u32,
}

fn parse_mix(text: &str) -> Result<Mix, String> {
    let (new, replay) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?}: expected new:replay, e.g. 80:20"))?;
    let parse = |part: &str| {
        part.trim()
            .parse::<u32>()
            .map_err(|error| format!("{part:?}: {error}"))
    };
    let mix = Mix {
        new: parse(new)?,
        replay: parse(replay)?,
    };
    if mix.new.checked_add(mix.replay).unwrap_or(0) == 0 {
        return Err("the mix needs a positive total".into());
    }
    Ok(mix)
}

/// Load generator for the idempotency service.
#[derive(Debug, Parser)]
#[command(name = "idempotency-bench", version, about)]
struct Cli {
    /// The service's gRPC endpoint.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    endpoint: String,
    /// What each operation does.
    #[arg(long, value_enum, default_value_t = Scenario::NewKeys)]
    scenario: Scenario,
    /// Operations in flight at once (one task each, one operation after another).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    concurrency: u64,
    /// How long the timed part runs (after the warm-up).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Run this many timed operations instead of a duration.
    #[arg(long, conflicts_with = "duration", value_parser = clap::value_parser!(u64).range(1..))]
    count: Option<u64>,
    /// How long to run before the timed part, not counted (connections, pools, caches).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Body size of each stored response.
    #[arg(long, default_value_t = 256)]
    payload_bytes: usize,
    /// gRPC (HTTP/2) connections, a client each; the tasks share them
    /// round-robin. One, as a service process has one client.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    connections: u64,
    /// Worker threads of the load generator's runtime. One by default: it
    /// stands in for callers on other machines, so it should take as little
    /// as it can of the CPUs it shares with the server and Postgres (on two
    /// cores, two threads cost about 40 % more CPU per call, mostly thread
    /// wake-ups, for no more throughput).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    threads: u64,
    /// contention: number of hot keys (default 4); replay and mixed: number of
    /// keys completed before the timed part (default 1000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    keys: Option<u64>,
    /// mixed: weights of new keys and replays.
    #[arg(long, default_value = "80:20", value_parser = parse_mix)]
    mix: Mix,
    /// contention: the hot keys get new names this often, so callers keep
    /// racing for fresh keys instead of only replaying (0s: never).
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    rotate_every: Duration,
    /// replay and mixed: name the prepared keys `r-<prefix>-<i>` instead of
    /// with a prefix unique to this run, so that later runs can reuse them.
    #[arg(long)]
    key_prefix: Option<String>,
    /// replay and mixed: the keys of --key-prefix were completed by an
    /// earlier run; do not prepare them (nothing is written before the timed part).
    #[arg(long, requires = "key_prefix")]
    skip_prepare: bool,
    /// Client-side batching: requests of one kind each client keeps on the
    /// wire before calls wait and share a batch RPC (the client's default).
    #[arg(long, default_value_t = Batching::default().max_in_flight as u64, value_parser = clap::value_parser!(u64).range(1..))]
    batch_in_flight: u64,
    /// Every call its own RPC (no client-side batching).
    #[arg(long)]
    no_batching: bool,
    /// Batches as RPCs, not as messages of the client's BatchStream.
    #[arg(long)]
    no_stream: bool,
    /// Deadline of each call.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Namespace of the keys.
    #[arg(long, default_value = "bench")]
    namespace: String,
    /// Operations started per second, over all tasks together (a task that
    /// falls behind starts its next at once, so the rate is reached only
    /// while the service keeps up); without it, as fast as answers come.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    rate: Option<u64>,
    /// New keys: random UUIDs (as real callers send) instead of
    /// `n-<run>-<task>-<random>`, whose shared prefix puts a run's inserts
    /// side by side in the primary key index.
    #[arg(long)]
    uuid_keys: bool,
    /// New keys: the subject of each, drawn at random from `user-0` ..
    /// `user-<N-1>` (default: one subject for every key).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    subjects: Option<u64>,
    /// Lifetime of every record (default: the server's, 24 h).
    #[arg(long, value_parser = humantime::parse_duration)]
    ttl: Option<Duration>,
    /// Also report the CPU seconds this process (the server, on this
    /// machine) used during the timed part, from /proc/<pid>/stat.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Connect over TLS (an https:// --endpoint), trusting the CA
    /// certificates (PEM) in this file to sign the service's.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Send `authorization: Bearer <token>` with every RPC, the token read
    /// from this file (again every few seconds, as a Kubernetes
    /// service-account token is).
    #[arg(long)]
    bearer_token_file: Option<PathBuf>,
    /// Write the files a server with TLS and auth on needs, and a client to
    /// call it, into this directory, then exit: `ca.crt`, `tls.crt`,
    /// `tls.key`, `jwks.json`, `jwt.token` (an RS256 JWT for
    /// --jwt-issuer and --jwt-audience), `static.token`, `tokens.toml` and
    /// `policy.toml` (both tokens' callers may use --namespace).
    #[arg(long, value_name = "DIR")]
    make_auth_files: Option<PathBuf>,
    /// --make-auth-files: the JWT's `iss`.
    #[arg(long, default_value = "https://kubernetes.default.svc.cluster.local")]
    jwt_issuer: String,
    /// --make-auth-files: the JWT's `aud`.
    #[arg(long, default_value = "idempotency")]
    jwt_audience: String,
    /// Print one JSON object instead of the text report.
    #[arg(long)]
    json: bool,
    /// Serve `grpc.health.v1` alone on this address (SERVING, plain text, no
    /// layers) for --serve-for, then exit: the floor for `--scenario health`.
    #[arg(long, value_name = "ADDR")]
    serve_health: Option<std::net::SocketAddr>,
    /// Serve the floor on this address for --serve-for, then exit: Acquire
    /// and Complete as pgbench's two statements on DATABASE_URL, behind tonic
    /// alone (`floor.rs`), the least a gRPC service over Postgres can cost.
    #[arg(long, value_name = "ADDR", conflicts_with = "serve_health")]
    serve_floor: Option<std::net::SocketAddr>,
    /// --serve-floor: the statements a batch runs, the durable ceiling's
    /// (multi-row INSERT and UPDATE) or the service's own.
    #[arg(long, value_enum, default_value_t, requires = "serve_floor")]
    floor_statements: floor::Statements,
    /// Run pgbench's statements through sqlx alone on DATABASE_URL, one at
    /// a time on one connection, for --warmup and then --duration, and
    /// print one JSON object (`driver.rs`): `select`, the primary-key read
    /// of replay.sql (--keys of replay_keys.sql, 1000 by default), or
    /// `pair`, the new-key pair of new_key_pair.sql. The driver's floor
    /// under every statement of the server.
    #[arg(long, value_name = "WORK", conflicts_with_all = ["serve_health", "serve_floor"])]
    driver_floor: Option<driver::Work>,
    /// --driver-floor: idle time before each operation, not timed (the gap
    /// between a service's statements while its caller's call crosses gRPC).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration,
          requires = "driver_floor")]
    driver_pause: Duration,
    /// --serve-health, --serve-floor: how long to serve.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    serve_for: Duration,
    /// New keys through the generated gRPC stub, one Acquire and one
    /// Complete RPC per pair, instead of the client library (no batching,
    /// no retries, no spans): with --serve-floor, a gRPC hop's floor.
    #[arg(long, conflicts_with_all = ["tls_ca", "bearer_token_file"])]
    raw_stub: bool,
    /// With --raw-stub: each caller's op is a batch of N new-key pairs, one
    /// BatchAcquire of N items and one BatchComplete of those it acquired,
    /// from the caller's own task: the least a caller that batches by hand
    /// does, against the client library's batching of N callers. Ops count
    /// batches; pairs are ops × N (the JSON's `pairs_per_op`) when every op
    /// acquired all N (its outcome "acquired"). An item answered with an
    /// error fails the op. The server answers batches of at most its
    /// --max-batch-items (100 by default).
    #[arg(long, requires = "raw_stub", value_parser = clap::value_parser!(u32).range(1..=1000))]
    raw_batch: Option<u32>,
    /// With --raw-batch: each caller sends its batches as messages of one
    /// bidirectional stream of its own instead of one unary RPC each
    /// (`steps.rs`), reopened after any error: what a streaming RPC would
    /// save. Served by --serve-floor, and by the server only with the
    /// measurement prototype of `make bench-stream` applied.
    #[arg(long, requires = "raw_batch")]
    raw_stream: bool,
}

/// What every worker shares.
struct Plan {
    scenario: Scenario,
    concurrency: u64,
    clients: Vec<Client>,
    /// `--scenario health`: one health stub per connection.
    health: Vec<HealthClient<Channel>>,
    /// `--raw-stub`: one generated stub per connection, in place of `clients`.
    raw: Vec<IdempotencyServiceClient<Channel>>,
    /// `--raw-batch`: new-key pairs per op through `raw`.
    raw_batch: Option<u32>,
    /// `--raw-stream`: the connections of `raw`, each caller's stream on one.
    raw_streams: Option<Vec<Channel>>,
    namespace: String,
    /// Each call's deadline.
    timeout: Duration,
    /// Distinguishes this run's keys from any earlier run's.
    run: String,
    fingerprint: Vec<u8>,
    response: StoredResponse,
    replay_keys: Vec<RecordId>,
    hot_keys: u64,
    rotate_every: Duration,
    mix: Mix,
    started: Instant,
    measure_from: Instant,
    /// Duration mode: no operation starts at or after this.
    measure_until: Option<Instant>,
    /// Count mode: timed operations left to hand out.
    tickets: Option<AtomicU64>,
    /// `--rate`: the interval between two operations' starts, and how many
    /// have been given a start time so far.
    pacing: Option<(Duration, AtomicU64)>,
    uuid_keys: bool,
    subjects: Option<u64>,
    ttl: Option<Duration>,
}

const OPERATION: &str = "POST /bench";
/// How late a `--rate` start may still be made up (see [`Plan::pace`]).
const RATE_SLACK: Duration = Duration::from_millis(100);
const SUBJECT: &str = "bench-subject";

impl Plan {
    /// The client of worker `index`: the workers share them round-robin.
    fn client(&self, index: u64) -> &Client {
        &self.clients[(index % self.clients.len() as u64) as usize]
    }

    /// `--raw-stub`: the stub for the caller at `index`.
    fn raw_stub(&self, index: u64) -> IdempotencyServiceClient<Channel> {
        self.raw[(index % self.raw.len() as u64) as usize].clone()
    }

    /// `--raw-stub`: a new key's Acquire, with `--ttl` as the client
    /// library's pairs send it.
    fn raw_acquire(&self, id: pb::RecordId) -> pb::AcquireRequest {
        pb::AcquireRequest {
            id: Some(id),
            fingerprint: self.fingerprint.clone(),
            ttl: self
                .ttl
                .and_then(|ttl| prost_types::Duration::try_from(ttl).ok()),
            lease: None,
        }
    }

    /// `--raw-stub`: the Complete of an acquired key, with the run's response.
    fn raw_complete(&self, id: pb::RecordId, fencing_token: u64) -> pb::CompleteRequest {
        pb::CompleteRequest {
            id: Some(id),
            fencing_token,
            response: Some(self.response.clone().into()),
        }
    }

    fn id(&self, key: String) -> RecordId {
        RecordId::new(self.namespace.clone(), OPERATION, key).with_subject(SUBJECT)
    }

    /// A fresh key, as `--uuid-keys` and `--subjects` ask.
    fn new_key(&self, rng: &mut fastrand::Rng, index: u64) -> RecordId {
        let key = if self.uuid_keys {
            uuid_v4(rng)
        } else {
            format!("n-{}-{index}-{:016x}", self.run, rng.u64(..))
        };
        match self.subjects {
            Some(subjects) => RecordId::new(self.namespace.clone(), OPERATION, key)
                .with_subject(format!("user-{}", rng.u64(0..subjects))),
            None => self.id(key),
        }
    }

    /// With `--rate`, waits for this operation's start time: the next free
    /// slot of the schedule, or at once when the schedule has fallen behind.
    /// Slots more than [`RATE_SLACK`] in the past are dropped, not made up:
    /// after a slow minute the rate stays the rate instead of bursting.
    async fn pace(&self) {
        if let Some((interval, handed_out)) = &self.pacing {
            let due = (self.started.elapsed().as_secs_f64() / interval.as_secs_f64()) as u64;
            let slack = (RATE_SLACK.as_secs_f64() / interval.as_secs_f64()) as u64;
            let slot = take_slot(handed_out, due.saturating_sub(slack));
            tokio::time::sleep_until(slot_start(self.started, *interval, slot).into()).await;
        }
    }

    /// False once the timed part is over.
    fn may_start(&self, now: Instant) -> bool {
        if now < self.measure_from {
            return true;
        }
        match (&self.tickets, self.measure_until) {
            (Some(tickets), _) => tickets
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                    left.checked_sub(1)
                })
                .is_ok(),
            (None, Some(until)) => now < until,
            (None, None) => false,
        }
    }
}

/// A random version 4 UUID (122 random bits), as text.
fn uuid_v4(rng: &mut fastrand::Rng) -> String {
    let (high, low) = (rng.u64(..), rng.u64(..));
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0x0fff,
        0x8000 | (low >> 48) & 0x3fff,
        low & 0xffff_ffff_ffff
    )
}

/// The next slot of a `--rate` schedule, skipping those before `oldest`.
fn take_slot(handed_out: &AtomicU64, oldest: u64) -> u64 {
    let taken = handed_out
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
            Some(next.max(oldest) + 1)
        })
        .unwrap_or_else(|next| next);
    taken.max(oldest)
}

/// When the operation given `slot` of a `--rate` schedule may start.
fn slot_start(started: Instant, interval: Duration, slot: u64) -> Instant {
    started + interval.saturating_mul(u32::try_from(slot).unwrap_or(u32::MAX))
}

fn outcome_name(acquisition: &Acquisition) -> &'static str {
    match acquisition {
        Acquisition::Proceed(_) => "acquired",
        Acquisition::InProgress { .. } => "in_progress",
        Acquisition::Replay(_) => "replay",
        Acquisition::Failed(_) => "failed",
        Acquisition::FingerprintMismatch => "fingerprint_mismatch",
    }
}

/// The outcome and the Acquire latency of one operation that got an answer.
type OpResult = Result<(&'static str, Duration), (&'static str, Error)>;

/// Acquire, and Complete at once when granted.
async fn acquire_and_complete(plan: &Plan, client: &Client, id: RecordId) -> OpResult {
    let mut request = AcquireRequest::new(id, plan.fingerprint.clone());
    if let Some(ttl) = plan.ttl {
        request = request.with_ttl(ttl);
    }
    let started = Instant::now();
    let acquisition = client
        .acquire(&request)
        .await
        .map_err(|error| ("acquire", error))?;
    let acquire_latency = started.elapsed();
    let outcome = outcome_name(&acquisition);
    if let Acquisition::Proceed(mut lease) = acquisition {
        lease
            .complete(&plan.response)
            .await
            .map_err(|error| ("complete", error))?;
    }
    Ok((outcome, acquire_latency))
}

/// A record id as the generated stub takes it.
fn raw_id(id: RecordId) -> pb::RecordId {
    pb::RecordId {
        namespace: id.namespace,
        operation: id.operation,
        subject: id.subject,
        key: id.key,
    }
}

/// `--raw-stub`: a new-key pair through the generated stub, as a caller
/// without the client library makes it: Acquire, then Complete with the
/// token it got.
async fn raw_pair(plan: &Plan, index: u64, id: RecordId) -> OpResult {
    let mut stub = plan.raw_stub(index);
    let unexpected = |rpc, status: tonic::Status| (rpc, Error::Unexpected(Box::new(status)));
    let pb_id = raw_id(id);
    let mut request = tonic::Request::new(plan.raw_acquire(pb_id.clone()));
    request.set_timeout(plan.timeout);
    let started = Instant::now();
    let acquired = stub
        .acquire(request)
        .await
        .map_err(|status| unexpected("acquire", status))?;
    let acquire_latency = started.elapsed();
    let Some(pb::acquire_response::Outcome::Acquired(acquired)) = acquired.into_inner().outcome
    else {
        return Ok(("not_acquired", acquire_latency));
    };
    let mut request = tonic::Request::new(plan.raw_complete(pb_id, acquired.fencing_token));
    request.set_timeout(plan.timeout);
    stub.complete(request)
        .await
        .map_err(|status| unexpected("complete", status))?;
    Ok(("acquired", acquire_latency))
}

/// `--raw-batch`: new-key pairs through the generated stub in one batch of
/// each kind: a BatchAcquire of `ids`, then a BatchComplete of those it
/// acquired with their tokens. "acquired" when it acquired them all; an
/// error when a Complete of the batch failed.
async fn raw_batch(
    plan: &Plan,
    index: u64,
    ids: Vec<RecordId>,
    stream: Option<&mut StepStream>,
) -> OpResult {
    let mut batches = match stream {
        Some(stream) => Batches::Stream(stream),
        None => Batches::Unary(plan.raw_stub(index), plan.timeout),
    };
    let unexpected = |rpc, status: tonic::Status| (rpc, Error::Unexpected(Box::new(status)));
    let ids: Vec<pb::RecordId> = ids.into_iter().map(raw_id).collect();
    let requests = ids.iter().map(|id| plan.raw_acquire(id.clone())).collect();
    let started = Instant::now();
    let results = batches
        .acquire(pb::BatchAcquireRequest { requests })
        .await
        .map_err(|status| unexpected("acquire", status))?
        .results;
    let acquire_latency = started.elapsed();
    if results.len() != ids.len() {
        let message = format!("{} results for {} Acquires", results.len(), ids.len());
        return Err(unexpected("acquire", tonic::Status::internal(message)));
    }
    let batch = ids.len();
    let mut completes = Vec::with_capacity(batch);
    for (id, result) in ids.into_iter().zip(results) {
        match result.result {
            Some(pb::batch_acquire_result::Result::Response(pb::AcquireResponse {
                outcome: Some(pb::acquire_response::Outcome::Acquired(acquired)),
            })) => completes.push(plan.raw_complete(id, acquired.fencing_token)),
            // Another outcome (a replay, in progress): not acquired, as in `raw_pair`.
            Some(pb::batch_acquire_result::Result::Response(_)) => {}
            Some(pb::batch_acquire_result::Result::Error(status)) => {
                let status = tonic::Status::new(status.code.into(), status.message);
                return Err(unexpected("acquire", status));
            }
            None => {
                let status = tonic::Status::internal("an Acquire of the batch went unanswered");
                return Err(unexpected("acquire", status));
            }
        }
    }
    let outcome = if completes.len() == batch {
        "acquired"
    } else {
        "not_acquired"
    };
    // The server refuses an empty batch: nothing acquired, nothing to complete.
    if completes.is_empty() {
        return Ok((outcome, acquire_latency));
    }
    let sent = completes.len();
    let completed = batches
        .complete(pb::BatchCompleteRequest {
            requests: completes,
        })
        .await
        .map_err(|status| unexpected("complete", status))?
        .results
        .iter()
        .filter(|result| {
            matches!(
                result.result,
                Some(pb::batch_complete_result::Result::Response(_))
            )
        })
        .count();
    if completed != sent {
        let status = tonic::Status::internal(format!("{completed} of {sent} Completes succeeded"));
        return Err(("complete", Error::Unexpected(Box::new(status))));
    }
    Ok((outcome, acquire_latency))
}

/// `--raw-stream`: [`raw_batch`] over the caller's stream, opened first
/// if it is not open; after any error it is dropped, and the next op opens
/// another (a late answer on it would be taken for the next message's).
async fn streamed_batch(
    plan: &Plan,
    index: u64,
    ids: Vec<RecordId>,
    channels: &[Channel],
    stream: &mut Option<StepStream>,
) -> OpResult {
    if stream.is_none() {
        let channel = channels[(index % channels.len() as u64) as usize].clone();
        let opened = StepStream::open(channel, plan.timeout)
            .await
            .map_err(|status| ("stream", Error::Unexpected(Box::new(status))))?;
        *stream = Some(opened);
    }
    let result = raw_batch(plan, index, ids, stream.as_mut()).await;
    if result.is_err() {
        *stream = None;
    }
    result
}

/// How `--raw-batch` sends its batches: one unary RPC each, with the
/// call's deadline, or as messages of the caller's stream (`--raw-stream`).
enum Batches<'s> {
    Unary(IdempotencyServiceClient<Channel>, Duration),
    Stream(&'s mut StepStream),
}

impl Batches<'_> {
    async fn acquire(
        &mut self,
        batch: pb::BatchAcquireRequest,
    ) -> Result<pb::BatchAcquireResponse, tonic::Status> {
        match self {
            Self::Unary(stub, timeout) => {
                let mut request = tonic::Request::new(batch);
                request.set_timeout(*timeout);
                Ok(stub.batch_acquire(request).await?.into_inner())
            }
            Self::Stream(stream) => stream.acquire(batch).await,
        }
    }

    async fn complete(
        &mut self,
        batch: pb::BatchCompleteRequest,
    ) -> Result<pb::BatchCompleteResponse, tonic::Status> {
        match self {
            Self::Unary(stub, timeout) => {
                let mut request = tonic::Request::new(batch);
                request.set_timeout(*timeout);
                Ok(stub.batch_complete(request).await?.into_inner())
            }
            Self::Stream(stream) => stream.complete(batch).await,
        }
    }
}

/// One `grpc.health.v1.Health/Check` of the whole server.
async fn health_check(plan: &Plan, index: u64) -> OpResult {
    let mut stub = plan.health[(index % plan.health.len() as u64) as usize].clone();
    let started = Instant::now();
    let mut request = tonic::Request::new(HealthCheckRequest::default());
    request.set_timeout(plan.timeout);
    match stub.check(request).await {
        Ok(response) if response.get_ref().status == ServingStatus::Serving as i32 => {
            Ok(("serving", started.elapsed()))
        }
        Ok(_) => Ok(("not_serving", started.elapsed())),
        Err(status) => Err(("health", Error::Unexpected(Box::new(status)))),
    }
}

async fn worker(plan: Arc<Plan>, index: u64, mut stats: Recorder) {
    // Each worker starts the round-robin over the replay keys at its own place.
    let replay_count = plan.replay_keys.len().max(1) as u64;
    let mut replay_next = index * replay_count / plan.concurrency;
    let mut rng = fastrand::Rng::with_seed(index ^ 0x9e37_79b9_7f4a_7c15);
    // `--raw-stream`: the caller's own stream, opened before its first op
    // and again after any error.
    let mut stream: Option<StepStream> = None;
    loop {
        plan.pace().await;
        let started = Instant::now();
        if !plan.may_start(started) {
            break;
        }
        let scenario = match plan.scenario {
            Scenario::Mixed => {
                if rng.u32(0..plan.mix.new + plan.mix.replay) < plan.mix.new {
                    Scenario::NewKeys
                } else {
                    Scenario::Replay
                }
            }
            other => other,
        };
        let result = match scenario {
            Scenario::NewKeys => {
                // Random within the worker's range, like pgbench's keys and
                // like real UUID keys: inserts land all over the index.
                let id = plan.new_key(&mut rng, index);
                match plan.raw_batch {
                    _ if plan.raw.is_empty() => {
                        acquire_and_complete(&plan, plan.client(index), id).await
                    }
                    None => raw_pair(&plan, index, id).await,
                    Some(pairs) => {
                        let mut ids = vec![id];
                        ids.extend((1..pairs).map(|_| plan.new_key(&mut rng, index)));
                        match &plan.raw_streams {
                            None => raw_batch(&plan, index, ids, None).await,
                            Some(channels) => {
                                streamed_batch(&plan, index, ids, channels, &mut stream).await
                            }
                        }
                    }
                }
            }
            Scenario::Replay => {
                let id = plan.replay_keys[(replay_next % replay_count) as usize].clone();
                replay_next += 1;
                acquire_and_complete(&plan, plan.client(index), id).await
            }
            Scenario::Contention => {
                let epoch = if plan.rotate_every.is_zero() {
                    0
                } else {
                    started.duration_since(plan.started).as_nanos() / plan.rotate_every.as_nanos()
                };
                let slot = rng.u64(0..plan.hot_keys);
                let id = plan.id(format!("hot-{}-{slot}-{epoch}", plan.run));
                acquire_and_complete(&plan, plan.client(index), id).await
            }
            Scenario::Health => health_check(&plan, index).await,
            Scenario::Mixed => unreachable!("resolved above"),
        };
        if started < plan.measure_from {
            stats.warmup_op(); // not measured
            continue;
        }
        match result {
            Ok((outcome, acquire_latency)) => stats.op(outcome, started.elapsed(), acquire_latency),
            Err((rpc, error)) => stats.error(rpc, &error),
        }
    }
}

/// The keys replay and mixed read.
fn replay_ids(namespace: &str, prefix: &str, count: u64) -> Vec<RecordId> {
    (0..count)
        .map(|i| {
            RecordId::new(namespace, OPERATION, format!("r-{prefix}-{i}")).with_subject(SUBJECT)
        })
        .collect()
}

/// Completes the keys before the timed part, for replay and mixed; keys
/// already completed (by an earlier run) are fine.
async fn prepare_replay_keys(
    clients: &[Client],
    ids: Vec<RecordId>,
    fingerprint: &[u8],
    response: &StoredResponse,
) -> anyhow::Result<Vec<RecordId>> {
    let ids = Arc::new(ids);
    let tasks = 32u64.min(ids.len() as u64);
    let mut handles = Vec::new();
    for task in 0..tasks {
        let ids = ids.clone();
        let client = clients[(task % clients.len() as u64) as usize].clone();
        let fingerprint = fingerprint.to_vec();
        let response = response.clone();
        handles.push(tokio::spawn(async move {
            for id in ids.iter().skip(task as usize).step_by(tasks as usize) {
                let request = AcquireRequest::new(id.clone(), fingerprint.clone());
                match client.acquire(&request).await? {
                    Acquisition::Proceed(mut lease) => lease.complete(&response).await?,
                    Acquisition::Replay(_) => {}
                    other => anyhow::bail!("preparing {}: {}", id.key, outcome_name(&other)),
                }
            }
            anyhow::Ok(())
        }));
    }
    for handle in handles {
        handle.await??;
    }
    Ok(Arc::try_unwrap(ids).unwrap_or_else(|ids| (*ids).clone()))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(dir) = &cli.make_auth_files {
        return auth_files::write(&auth_files::Settings {
            dir,
            namespace: &cli.namespace,
            issuer: &cli.jwt_issuer,
            audience: &cli.jwt_audience,
        });
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.threads as usize)
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(async {
            if let Some(work) = cli.driver_floor {
                let database = std::env::var("DATABASE_URL")
                    .context("--driver-floor needs DATABASE_URL")?
                    .parse()
                    .context("DATABASE_URL")?;
                let settings = driver::Settings {
                    work,
                    keys: cli.keys.unwrap_or(1000),
                    warmup: cli.warmup,
                    duration: cli.duration,
                    pause: cli.driver_pause,
                };
                // On a worker thread, as the server's statements run.
                return tokio::spawn(driver::run(database, settings)).await?;
            }
            if let Some(addr) = cli.serve_floor {
                let database = std::env::var("DATABASE_URL")
                    .context("--serve-floor needs DATABASE_URL")?
                    .parse()
                    .context("DATABASE_URL")?;
                let listener = listen(addr, "the floor", cli.serve_for).await?;
                return floor::serve(listener, database, cli.floor_statements, cli.serve_for).await;
            }
            match cli.serve_health {
                Some(addr) => {
                    let listener = listen(addr, "grpc.health.v1", cli.serve_for).await?;
                    serve_health(listener, cli.serve_for).await
                }
                None => run(cli).await.map(drop),
            }
        })
}

/// Binds `addr` for `--serve-health` or `--serve-floor` and says what serves there.
async fn listen(
    addr: std::net::SocketAddr,
    what: &str,
    serve_for: Duration,
) -> anyhow::Result<tokio::net::TcpListener> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    eprintln!("idempotency-bench: serving {what} on {addr} for {serve_for:?}");
    Ok(listener)
}

/// `--serve-health`: tonic's health service alone, with tonic's defaults
/// (and `TCP_NODELAY`, as the service and every client here set it).
async fn serve_health(
    listener: tokio::net::TcpListener,
    serve_for: Duration,
) -> anyhow::Result<()> {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, tokio::time::sleep(serve_for))
        .await
        .context("serving health")
}

/// A channel of its own (one HTTP/2 connection) with tonic's defaults and
/// `TCP_NODELAY`, as the client library sets it.
async fn plain_channel(endpoint: &str) -> anyhow::Result<Channel> {
    Channel::from_shared(endpoint.to_owned())
        .context("--endpoint")?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to {endpoint}"))
}

/// Runs the load and prints the report; returns what was counted.
async fn run(cli: Cli) -> anyhow::Result<Stats> {
    if cli.scenario == Scenario::Contention && cli.concurrency < 2 {
        eprintln!("idempotency-bench: contention with one caller never contends");
    }
    if cli.duration.is_zero() && cli.count.is_none() {
        bail!("--duration must be positive");
    }

    // `--scenario health` calls the health service alone, through its own
    // stubs, and `--raw-stub` the idempotency service through its own.
    if cli.raw_stub && cli.scenario != Scenario::NewKeys {
        bail!("--raw-stub makes new-key pairs only (--scenario new-keys)");
    }
    let client_connections = match cli.scenario {
        Scenario::Health => 0,
        _ if cli.raw_stub => 0,
        _ => cli.connections,
    };
    let mut clients = Vec::new();
    for _ in 0..client_connections {
        // One builder per connection: each gets its own channel, so its own
        // HTTP/2 connection (one channel multiplexes every call on one).
        let mut builder = Client::builder()
            .endpoint(cli.endpoint.clone())
            .timeout(cli.timeout)
            .retry(RetryPolicy::none())
            .batching((!cli.no_batching).then(|| Batching {
                max_in_flight: cli.batch_in_flight as usize,
                stream: !cli.no_stream,
                ..Batching::default()
            }));
        if let Some(ca) = &cli.tls_ca {
            builder = builder.tls_files(TlsFiles::new(ca));
        }
        if let Some(path) = &cli.bearer_token_file {
            builder = builder.bearer_token(TokenSource::file(path));
        }
        let client = builder
            .connect()
            .await
            .with_context(|| format!("connecting to {}", cli.endpoint))?;
        clients.push(client);
    }

    let mut health = Vec::new();
    if cli.scenario == Scenario::Health {
        if cli.tls_ca.is_some() || cli.bearer_token_file.is_some() {
            bail!("--scenario health speaks plain text without credentials");
        }
        for _ in 0..cli.connections {
            health.push(HealthClient::new(plain_channel(&cli.endpoint).await?));
        }
    }
    let mut raw = Vec::new();
    let mut raw_channels = Vec::new();
    if cli.raw_stub {
        for _ in 0..cli.connections {
            let channel = plain_channel(&cli.endpoint).await?;
            raw_channels.push(channel.clone());
            raw.push(IdempotencyServiceClient::new(channel));
        }
    }

    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let run = format!("{:x}{:x}", nanos, std::process::id());
    // A SHA-256-sized fingerprint, as a real caller sends.
    let fingerprint: Vec<u8> = (0u8..32).collect();
    // No headers: the pgbench scripts store '{}' too.
    let response = StoredResponse::new(201, vec![b'x'; cli.payload_bytes]);

    let keys = cli.keys.unwrap_or(match cli.scenario {
        Scenario::Contention => 4,
        _ => 1000,
    });
    let key_prefix = cli.key_prefix.clone().unwrap_or_else(|| run.clone());
    let replay_keys = match cli.scenario {
        Scenario::Replay | Scenario::Mixed if cli.skip_prepare => {
            replay_ids(&cli.namespace, &key_prefix, keys)
        }
        Scenario::Replay | Scenario::Mixed => {
            prepare_replay_keys(
                &clients,
                replay_ids(&cli.namespace, &key_prefix, keys),
                &fingerprint,
                &response,
            )
            .await?
        }
        _ => Vec::new(),
    };

    let started = Instant::now();
    let measure_from = started + cli.warmup;
    let plan = Arc::new(Plan {
        scenario: cli.scenario,
        concurrency: cli.concurrency,
        clients,
        health,
        raw,
        raw_batch: cli.raw_batch,
        raw_streams: cli.raw_stream.then_some(raw_channels),
        timeout: cli.timeout,
        namespace: cli.namespace.clone(),
        run,
        fingerprint,
        response,
        replay_keys,
        hot_keys: keys,
        rotate_every: cli.rotate_every,
        mix: cli.mix,
        started,
        measure_from,
        measure_until: cli.count.is_none().then(|| measure_from + cli.duration),
        tickets: cli.count.map(AtomicU64::new),
        pacing: cli.rate.map(|rate| {
            (
                Duration::from_secs_f64(1.0 / rate as f64),
                AtomicU64::new(0),
            )
        }),
        uuid_keys: cli.uuid_keys,
        subjects: cli.subjects,
        ttl: cli.ttl,
    });

    let shared = Arc::new(Mutex::new(Stats::default()));
    // The callers are spawned from a task on the runtime, not from this
    // thread (`block_on`'s, outside the runtime's workers): spawned from here
    // they went through the runtime's shared queue while its worker already
    // ran the first of them, so the first few sent their calls before the
    // rest existed. With the client library's batching that started more than
    // half the runs at sixteen callers as two groups taking turns (about 8
    // calls per batch), which merged into one after 1 to more than 4
    // seconds, often past the 2 s warm-up. Spawned from one task they all
    // start in the same turn of the scheduler (with the default single
    // worker thread; with more, idle workers may steal some as they are
    // spawned), as callers that arrive together do (docs/performance.md,
    // "Sixteen callers: one group or two").
    let handles: Vec<_> = {
        let (plan, shared, concurrency) = (plan.clone(), shared.clone(), cli.concurrency);
        tokio::spawn(async move {
            (0..concurrency)
                .map(|index| {
                    let plan = plan.clone();
                    let recorder = Recorder::new(shared.clone());
                    tokio::spawn(async move {
                        worker(plan, index, recorder).await;
                        Instant::now()
                    })
                })
                .collect()
        })
        .await
        .context("spawning the callers")?
    };
    tokio::time::sleep_until(measure_from.into()).await;
    let server_pid = cli.server_pid.map(|pid| pid.to_string());
    let sample = || {
        (
            process_cpu_seconds("self"),
            server_pid.as_deref().and_then(process_cpu_seconds),
            machine_cpu_ticks(),
        )
    };
    let (client_cpu_before, server_cpu_before, machine_before) = sample();

    let mut finished = measure_from;
    for handle in handles {
        let done = handle.await.context("a worker panicked")?;
        finished = finished.max(done);
    }
    let total = stats::collected(shared).context("a worker outlived the run")?;
    let seconds = finished.duration_since(measure_from).as_secs_f64();
    let (client_cpu_after, server_cpu_after, machine_after) = sample();
    let delta = |before: Option<f64>, after: Option<f64>| match (before, after) {
        (Some(before), Some(after)) => Some(((after - before) * 100.0).round() / 100.0),
        _ => None,
    };
    let client_cpu = delta(client_cpu_before, client_cpu_after);
    let server_cpu = delta(server_cpu_before, server_cpu_after);
    let machine_busy =
        busy_fraction(machine_before, machine_after).map(|b| (b * 1000.0).round() / 1000.0);
    let ops_per_sec = if seconds > 0.0 {
        total.ops as f64 / seconds
    } else {
        0.0
    };

    if cli.json {
        let report = json!({
            "scenario": cli.scenario.name(),
            "endpoint": cli.endpoint,
            "concurrency": cli.concurrency,
            "connections": cli.connections,
            "threads": cli.threads,
            "tls": cli.tls_ca.is_some(),
            "bearer_token": cli.bearer_token_file.is_some(),
            "batching": if cli.no_batching { serde_json::Value::Null } else { serde_json::json!({"max_in_flight": cli.batch_in_flight, "stream": !cli.no_stream}) },
            "payload_bytes": cli.payload_bytes,
            "keys": keys,
            "mix": format!("{}:{}", cli.mix.new, cli.mix.replay),
            "rate": cli.rate,
            "uuid_keys": cli.uuid_keys,
            "subjects": cli.subjects,
            "ttl_seconds": cli.ttl.map(|ttl| ttl.as_secs_f64()),
            "warmup_seconds": cli.warmup.as_secs_f64(),
            "warmup_ops": total.warmup_ops,
            "ops": total.ops,
            "errors_total": total.errors_total(),
            "seconds": (seconds * 1000.0).round() / 1000.0,
            "ops_per_sec": (ops_per_sec * 10.0).round() / 10.0,
            "pairs_per_op": cli.raw_batch.unwrap_or(1),
            "raw_stream": cli.raw_stream,
            "latency_us": percentiles(&total.latency),
            "acquire_latency_us": percentiles(&total.acquire_latency),
            "outcomes": total.outcomes,
            "errors": total.errors,
            "client_cpu_seconds": client_cpu,
            "server_cpu_seconds": server_cpu,
            "machine_cpu_busy": machine_busy,
        });
        println!("{report}");
    } else {
        println!(
            "{} at concurrency {} over {} connection(s): {} ops in {:.2} s = {:.1} ops/s",
            cli.scenario.name(),
            cli.concurrency,
            cli.connections,
            total.ops,
            seconds,
            ops_per_sec
        );
        if let Some(pairs) = cli.raw_batch {
            println!(
                "{pairs} new-key pairs per op (--raw-batch): {:.1} pairs/s",
                ops_per_sec * f64::from(pairs)
            );
        }
        println!("latency (operation): {}", percentiles_line(&total.latency));
        println!(
            "latency (Acquire):   {}",
            percentiles_line(&total.acquire_latency)
        );
        let outcomes: Vec<String> = total
            .outcomes
            .iter()
            .map(|(outcome, n)| format!("{outcome}={n}"))
            .collect();
        println!("outcomes: {}", outcomes.join(" "));
        if total.errors.is_empty() {
            println!("errors: none");
        } else {
            let errors: Vec<String> = total
                .errors
                .iter()
                .map(|(code, n)| format!("{code}={n}"))
                .collect();
            println!("errors: {}", errors.join(" "));
        }
        if let Some(cpu) = client_cpu {
            println!("load generator CPU: {cpu:.2} s");
        }
        if let Some(cpu) = server_cpu {
            println!("server CPU: {cpu:.2} s");
        }
        if let Some(busy) = machine_busy {
            println!("machine CPU busy: {:.1} %", busy * 100.0);
        }
    }
    for (code, message) in &total.error_samples {
        eprintln!("idempotency-bench: first {code}: {message}");
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--scenario health` against `endpoint`, without a warm-up, with `more`.
    fn health_cli(endpoint: &str, more: &[&str]) -> Cli {
        let base = [
            "idempotency-bench",
            "--endpoint",
            endpoint,
            "--scenario",
            "health",
        ];
        let warmup = ["--warmup", "0s"];
        Cli::parse_from(base.iter().chain(&warmup).chain(more))
    }

    #[tokio::test]
    async fn the_health_scenario_measures_round_trips_to_the_bare_health_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(serve_health(listener, Duration::from_secs(30)));
        let cli = health_cli(
            &endpoint,
            &["--concurrency", "4", "--connections", "2", "--count", "40"],
        );
        let stats = run(cli).await.unwrap();
        assert_eq!(stats.ops, 40);
        assert_eq!(stats.outcomes.get("serving"), Some(&40));
        assert!(stats.errors.is_empty(), "{:?}", stats.error_samples);
        assert_eq!(stats.latency.len(), 40);
        server.abort();
    }

    #[tokio::test]
    async fn the_health_scenario_fails_when_no_server_is_there() {
        // A port nobody listens on: connecting fails, and the run says so.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let cli = health_cli(&endpoint, &["--count", "1"]);
        assert!(run(cli).await.is_err());
    }

    #[tokio::test]
    async fn the_floor_serves_new_key_pairs_with_the_ceilings_statements() {
        floor_serves_new_key_pairs(floor::Statements::Ceiling).await;
    }

    #[tokio::test]
    async fn the_floor_serves_new_key_pairs_with_the_services_statements() {
        floor_serves_new_key_pairs(floor::Statements::Service).await;
    }

    /// A batch's Acquires of `keys` through the stub: each one's answer
    /// (its token, lease and expiry), or `None` where it was refused.
    async fn batch_acquire(
        stub: &mut IdempotencyServiceClient<Channel>,
        id: &impl Fn(&str) -> pb::RecordId,
        keys: &[&str],
    ) -> Vec<Option<pb::Acquired>> {
        let requests = keys
            .iter()
            .map(|key| pb::AcquireRequest {
                id: Some(id(key)),
                fingerprint: vec![7; 32],
                ..Default::default()
            })
            .collect();
        let results = stub
            .batch_acquire(pb::BatchAcquireRequest { requests })
            .await
            .unwrap()
            .into_inner()
            .results;
        results
            .into_iter()
            .map(|result| match result.result {
                Some(pb::batch_acquire_result::Result::Response(pb::AcquireResponse {
                    outcome: Some(pb::acquire_response::Outcome::Acquired(acquired)),
                })) => Some(acquired),
                _ => None,
            })
            .collect()
    }

    /// `--serve-floor` on a database of its own (under DATABASE_URL, as
    /// `make test` sets it), called through the generated stub and through
    /// the client library: every pair is answered and stored completed. Then
    /// batches through the stub: each item answered in its place, a key that
    /// exists refused, a Complete with the wrong token finding no attempt.
    async fn floor_serves_new_key_pairs(statements: floor::Statements) {
        use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, postgres::PgConnectOptions};
        let admin_options: PgConnectOptions = std::env::var("DATABASE_URL")
            .expect("DATABASE_URL is not set: run the tests with `make test`")
            .parse()
            .unwrap();
        let name = format!("bench_floor_{statements:?}_{}", std::process::id()).to_lowercase();
        let mut admin = PgConnection::connect_with(&admin_options).await.unwrap();
        admin
            .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
            .await
            .unwrap();
        admin
            .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        let database = admin_options.database(&name);
        let mut connection = PgConnection::connect_with(&database).await.unwrap();
        sqlx::migrate!("../migrations")
            .run(&mut connection)
            .await
            .unwrap();

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(floor::serve(
            listener,
            database,
            statements,
            Duration::from_secs(60),
        ));
        let new_keys = |more: &[&str]| {
            let base = [
                "idempotency-bench",
                "--endpoint",
                &endpoint,
                "--warmup",
                "0s",
            ];
            let count = ["--concurrency", "3", "--count", "20"];
            Cli::parse_from(base.iter().chain(&count).chain(more))
        };
        let batches = ["--raw-stub", "--raw-batch", "4"];
        let streamed = ["--raw-stub", "--raw-batch", "4", "--raw-stream"];
        for cli in [
            new_keys(&["--raw-stub"]),
            new_keys(&[]),
            new_keys(&batches),
            new_keys(&streamed),
        ] {
            let stats = run(cli).await.unwrap();
            assert!(stats.errors.is_empty(), "{:?}", stats.error_samples);
            assert_eq!(stats.ops, 20);
            assert_eq!(stats.outcomes.get("acquired"), Some(&20));
        }
        let completed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_records WHERE state = 'completed'",
        )
        .fetch_one(&mut connection)
        .await
        .unwrap();
        assert_eq!(completed, 20 + 20 + 20 * 4 + 20 * 4);

        // Steps of one stream (`--raw-stream`): each answered in order, as
        // its unary batch RPC would be, and a key that exists refused.
        let channel = plain_channel(&endpoint).await.unwrap();
        let mut stream = StepStream::open(channel, Duration::from_secs(10))
            .await
            .unwrap();
        let stream_id = |key: &str| pb::RecordId {
            namespace: "floor-stream".into(),
            operation: "POST /floor".into(),
            subject: "s".into(),
            key: key.into(),
        };
        let acquires = |keys: &[&str]| pb::BatchAcquireRequest {
            requests: keys
                .iter()
                .map(|key| pb::AcquireRequest {
                    id: Some(stream_id(key)),
                    fingerprint: vec![7; 32],
                    ..Default::default()
                })
                .collect(),
        };
        let tokens: Vec<Option<u64>> = stream
            .acquire(acquires(&["stream-key-2", "stream-key-1"]))
            .await
            .unwrap()
            .results
            .into_iter()
            .map(|result| match result.result {
                Some(pb::batch_acquire_result::Result::Response(pb::AcquireResponse {
                    outcome: Some(pb::acquire_response::Outcome::Acquired(acquired)),
                })) => Some(acquired.fencing_token),
                _ => None,
            })
            .collect();
        assert!(tokens.iter().all(Option::is_some), "{tokens:?}");
        let again = stream
            .acquire(acquires(&["stream-key-1"]))
            .await
            .unwrap()
            .results;
        assert!(
            matches!(
                again[0].result,
                Some(pb::batch_acquire_result::Result::Error(_))
            ),
            "a key that exists: {again:?}"
        );
        let completes = pb::BatchCompleteRequest {
            requests: ["stream-key-2", "stream-key-1"]
                .iter()
                .zip(&tokens)
                .map(|(key, token)| pb::CompleteRequest {
                    id: Some(stream_id(key)),
                    fencing_token: token.unwrap(),
                    response: Some(pb::StoredResponse {
                        status_code: 201,
                        ..Default::default()
                    }),
                })
                .collect(),
        };
        let completed = stream.complete(completes).await.unwrap().results;
        assert!(
            completed.iter().all(|result| matches!(
                result.result,
                Some(pb::batch_complete_result::Result::Response(_))
            )),
            "{completed:?}"
        );
        let stored: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_records
             WHERE namespace = 'floor-stream' AND state = 'completed' AND response_status = 201",
        )
        .fetch_one(&mut connection)
        .await
        .unwrap();
        assert_eq!(stored, 2);
        // An error for a message as a whole (an item without an id) ends
        // the stream, as steps.rs says: the next step fails, and a stream
        // opened again is answered.
        let no_id = pb::BatchAcquireRequest {
            requests: vec![pb::AcquireRequest::default()],
        };
        let refused = stream.acquire(no_id).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(stream.acquire(acquires(&["stream-key-3"])).await.is_err());
        let channel = plain_channel(&endpoint).await.unwrap();
        let mut stream = StepStream::open(channel, Duration::from_secs(10))
            .await
            .unwrap();
        let results = stream
            .acquire(acquires(&["stream-key-3"]))
            .await
            .unwrap()
            .results;
        assert!(
            matches!(
                results[0].result,
                Some(pb::batch_acquire_result::Result::Response(_))
            ),
            "{results:?}"
        );

        // Batches through the generated stub: one statement per RPC.
        let mut stub = IdempotencyServiceClient::connect(endpoint.clone())
            .await
            .unwrap();
        let id = |key: &str| pb::RecordId {
            namespace: "floor".into(),
            operation: "POST /floor".into(),
            subject: format!("s-{}", key.len()),
            key: key.into(),
        };
        // Keys out of the service's order (by subject, then key), so that
        // an item answered in the statement's order would be misplaced.
        let first = batch_acquire(&mut stub, &id, &["batch-key-22", "batch-key-1"]).await;
        let second = batch_acquire(&mut stub, &id, &["batch-key-333", "batch-key-1"]).await;
        let answered = |acquired: &[Option<pb::Acquired>]| {
            acquired.iter().map(Option::is_some).collect::<Vec<_>>()
        };
        assert_eq!(answered(&first), [true, true]);
        assert_eq!(answered(&second), [true, false]);
        let tokens: Vec<(String, i64)> = sqlx::query_as(
            "SELECT key, fencing_token FROM idempotency_records
             WHERE namespace = 'floor' ORDER BY key",
        )
        .fetch_all(&mut connection)
        .await
        .unwrap();
        // The stored tokens are the ones answered. (With the ceiling's
        // statements every token is 1, so this shows nothing of placement
        // there: `answered` above does.)
        let token = |acquired: &Option<pb::Acquired>| acquired.as_ref().unwrap().fencing_token;
        let given = [
            ("batch-key-1".to_owned(), token(&first[1]) as i64),
            ("batch-key-22".to_owned(), token(&first[0]) as i64),
            ("batch-key-333".to_owned(), token(&second[0]) as i64),
        ];
        assert_eq!(
            tokens, given,
            "each item answered with its own record's token"
        );
        for acquired in first.iter().chain(&second[..1]) {
            let acquired = acquired.as_ref().unwrap();
            let lease = acquired.lease_expires_at.as_ref().unwrap().seconds;
            let expires = acquired.expires_at.as_ref().unwrap().seconds;
            assert!(
                lease + 3600 < expires,
                "a lease of 60 s, a lifetime of 24 h"
            );
        }
        // The middle one with a token it was not given.
        let completes = [
            ("batch-key-1", token(&first[1])),
            ("batch-key-333", token(&second[0]) + 1),
            ("batch-key-22", token(&first[0])),
        ]
        .iter()
        .map(|&(key, token)| pb::CompleteRequest {
            id: Some(id(key)),
            fencing_token: token,
            response: Some(pb::StoredResponse {
                status_code: 201,
                body: b"done".to_vec(),
                ..Default::default()
            }),
        })
        .collect();
        let completed = stub
            .batch_complete(pb::BatchCompleteRequest {
                requests: completes,
            })
            .await
            .unwrap()
            .into_inner()
            .results;
        let answered: Vec<bool> = completed
            .iter()
            .map(|result| {
                matches!(
                    result.result,
                    Some(pb::batch_complete_result::Result::Response(_))
                )
            })
            .collect();
        assert_eq!(answered, [true, false, true]);
        let stored: Vec<(String, String, Option<Vec<u8>>)> = sqlx::query_as(
            "SELECT key, state, response_body FROM idempotency_records
             WHERE namespace = 'floor' ORDER BY key",
        )
        .fetch_all(&mut connection)
        .await
        .unwrap();
        let done = |key: &str| {
            (
                key.to_owned(),
                "completed".to_owned(),
                Some(b"done".to_vec()),
            )
        };
        let open = |key: &str| (key.to_owned(), "in_progress".to_owned(), None);
        assert_eq!(
            stored,
            [
                done("batch-key-1"),
                done("batch-key-22"),
                open("batch-key-333")
            ]
        );

        server.abort();
        drop(connection);
        admin
            .execute(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .await
            .unwrap();
    }

    #[test]
    fn uuid_keys_are_version_4_uuids() {
        let mut rng = fastrand::Rng::with_seed(7);
        let keys: Vec<String> = (0..1000).map(|_| uuid_v4(&mut rng)).collect();
        for key in &keys {
            let bytes = key.as_bytes();
            assert_eq!(key.len(), 36, "{key}");
            for (i, byte) in bytes.iter().enumerate() {
                match i {
                    8 | 13 | 18 | 23 => assert_eq!(*byte, b'-', "{key}"),
                    14 => assert_eq!(*byte, b'4', "{key}"),
                    19 => assert!(b"89ab".contains(byte), "{key}"),
                    _ => assert!(
                        byte.is_ascii_hexdigit() && !byte.is_ascii_uppercase(),
                        "{key}"
                    ),
                }
            }
        }
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
    }

    #[test]
    fn a_rate_schedule_spaces_starts_evenly() {
        let started = Instant::now();
        let interval = Duration::from_secs_f64(1.0 / 4000.0);
        assert_eq!(slot_start(started, interval, 0), started);
        let second = slot_start(started, interval, 4000) - started;
        assert!((second.as_secs_f64() - 1.0).abs() < 1e-6, "{second:?}");
    }

    #[test]
    fn a_rate_schedule_drops_the_starts_it_fell_behind_on() {
        let handed_out = AtomicU64::new(0);
        assert_eq!(take_slot(&handed_out, 0), 0);
        assert_eq!(take_slot(&handed_out, 0), 1);
        // Fell behind: slots 2..=99 are dropped, not run in a burst.
        assert_eq!(take_slot(&handed_out, 100), 100);
        assert_eq!(take_slot(&handed_out, 100), 101);
        assert_eq!(handed_out.load(Ordering::Relaxed), 102);
    }
}
