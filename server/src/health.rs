//! `grpc.health.v1`: SERVING while the database answers the statement calls
//! need, NOT_SERVING while it does not, and NOT_SERVING for good once
//! shutdown begins.
//!
//! The promise, for the health check interval `I`: NOT_SERVING within 2 × I
//! of the database no longer answering (frozen, the table locked,
//! unreachable, out of connection slots), SERVING within 1 × I of it
//! answering again, and never a stale NOT_SERVING after that. The schedule
//! that keeps it (`Schedule`) is apart from the I/O (`attempt`), and
//! tested on tokio's paused clock.

use std::{future::Future, sync::Arc, time::Duration};

use sqlx::{ConnectOptions, Connection, postgres::PgConnectOptions};
use tokio::time::Instant;
use tonic_health::{ServingStatus, server::HealthReporter};

use crate::{
    grpc::{GrpcService, service::IdempotencyServiceServer},
    metrics::{DATABASE_PROBE_DURATION_SECONDS, DATABASE_PROBES_TOTAL, DATABASE_UP},
};

/// The health service name a liveness probe asks: SERVING for as long as the
/// process runs, whatever the database does, so an outage takes replicas out
/// of rotation (readiness, service "") without restarting them.
pub const LIVENESS: &str = "liveness";

/// What a probe asks: the primary-key lookup of a key that cannot exist
/// (keys are 8 to 128 characters), the same index path as every call. A
/// table lock that would block calls blocks it (it needs the table's
/// ACCESS SHARE lock); it reads one index page and writes nothing. Simple
/// query protocol: one round trip, no statement to prepare.
///
/// It also reads whether the session may write: a standby (an old primary
/// after a failover, reached through a stale DNS name or a proxy that has
/// not noticed) answers the lookup but refuses every Acquire, so it counts
/// as down.
const PROBE: &str = "SELECT current_setting('transaction_read_only') AS read_only \
                     FROM (SELECT 1) AS one LEFT JOIN idempotency_records \
                     ON namespace = '' AND operation = '' AND subject = '' AND key = ''";

/// Sets the overall ("") and the service's status together.
pub async fn set(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    match status {
        ServingStatus::Serving => {
            reporter
                .set_serving::<IdempotencyServiceServer<GrpcService>>()
                .await
        }
        _ => {
            reporter
                .set_not_serving::<IdempotencyServiceServer<GrpcService>>()
                .await
        }
    }
}

/// When probes run and how long one may take, from the interval `I`.
///
/// * A round (one or more connection attempts) has `I / 2` to get an
///   answer; else it failed. The last good round began at most `I` before
///   the database stopped answering, the next begins within `I` of it and
///   fails by `I / 2` later: NOT_SERVING within 1.5 × I, half an interval
///   inside the promise for a loaded scheduler.
/// * While NOT_SERVING, rounds begin every `I / 2` (every `I` while
///   SERVING). The round in flight when the database comes back ends
///   within `I / 2`, so the next begins within `I / 2` of the recovery and
///   answers within `I / 2` more: SERVING within 1 × I.
/// * Within a round, a failed attempt (refused, reset, `too many
///   connections`) is retried after `I / 10` on a fresh connection, so one
///   transient error does not take the replica out of rotation, and a
///   connection that died with an outage is never what reports the
///   database down after it is back.
///
/// Rounds run one after the other, never overlapping, and a result is
/// applied when its round ends, at most `I / 2` after it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    interval: Duration,
}

impl Schedule {
    pub(crate) fn new(interval: Duration) -> Self {
        Self { interval }
    }

    /// How long a round may try before it counts as failed.
    pub(crate) fn timeout(self) -> Duration {
        self.interval / 2
    }

    /// The pause after a failed attempt before the next within a round.
    fn retry_pause(self) -> Duration {
        self.interval / 10
    }

    /// From the start of a round to the start of the next.
    fn period(self, up: bool) -> Duration {
        if up { self.interval } else { self.interval / 2 }
    }
}

/// Why a round failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ProbeFailure {
    /// No attempt answered within the round's time: frozen, locked or
    /// overloaded.
    Timeout(Duration),
    /// Every attempt failed, the last with this error (refused, out of
    /// connection slots, authentication).
    Error(String),
}

impl ProbeFailure {
    /// The `result` label of [`DATABASE_PROBES_TOTAL`].
    fn label(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Error(_) => "error",
        }
    }
}

impl std::fmt::Display for ProbeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout(limit) => write!(f, "no answer within {limit:?}"),
            Self::Error(error) => write!(f, "{error}"),
        }
    }
}

/// One finished round, as the loop reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Round {
    pub(crate) result: Result<(), ProbeFailure>,
    /// From the round's start to its end.
    pub(crate) elapsed: Duration,
    /// The result differs from the previous round's (the first round always
    /// counts as a change).
    pub(crate) changed: bool,
}

/// Tries `attempt` until one succeeds or the round's time is up.
async fn round<F, Fut, E>(schedule: Schedule, attempt: &mut F) -> Result<(), ProbeFailure>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let mut last_error = None;
    let attempts = async {
        loop {
            match attempt().await {
                Ok(()) => return,
                Err(error) => last_error = Some(error.to_string()),
            }
            tokio::time::sleep(schedule.retry_pause()).await;
        }
    };
    // Dropping an attempt that ran out of time drops its connection with
    // it: a frozen socket is never reused.
    match tokio::time::timeout(schedule.timeout(), attempts).await {
        Ok(()) => Ok(()),
        Err(_) => Err(match last_error {
            Some(error) => ProbeFailure::Error(error),
            None => ProbeFailure::Timeout(schedule.timeout()),
        }),
    }
}

/// Runs rounds of `attempt` on `schedule` and hands each result to `report`,
/// until dropped. The next round starts after `report` returns.
pub(crate) async fn watch<F, Fut, E, R, RFut>(schedule: Schedule, mut attempt: F, mut report: R)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
    R: FnMut(Round) -> RFut,
    RFut: Future<Output = ()>,
{
    let mut last_up = None;
    loop {
        let started = Instant::now();
        let result = round(schedule, &mut attempt).await;
        let up = result.is_ok();
        let changed = last_up != Some(up);
        last_up = Some(up);
        report(Round {
            result,
            elapsed: started.elapsed(),
            changed,
        })
        .await;
        tokio::time::sleep_until(started + schedule.period(up)).await;
    }
}

/// Probes the database `options` name every `interval` and reports the
/// result. Runs until aborted.
///
/// Every attempt opens a connection of its own, outside the pool, and
/// closes it: a pool that is busy (every connection in use, calls waiting)
/// means a loaded database, not an unreachable one, and taking a loaded
/// replica out of rotation only moves its load onto the others. A fresh
/// connection is what a call needs when the pool grows or replaces one, so
/// a database that refuses new connections (`too many connections`,
/// SQLSTATE 53300) reads as down, and no connection that died in an outage
/// outlives it. It costs one connection set-up per replica per interval.
///
/// The trade-off for a database that is loaded but answering: a round that
/// gets no answer within half an interval (2.5 s at the default 5 s)
/// counts as down, at once, without waiting for a second miss (2 × I
/// leaves room for one timed-out round only). A database that slow to
/// answer one index lookup on a new connection is about as slow for calls;
/// when it answers in time again the next round, half an interval later,
/// restores SERVING. A longer interval tolerates slower answers, and
/// detects outages as much later.
pub async fn watch_database(
    options: Arc<PgConnectOptions>,
    reporter: HealthReporter,
    interval: Duration,
) {
    let schedule = Schedule::new(interval);
    // The server ends the probe's statement too, so a probe that waits on a
    // lock does not stay behind in Postgres, one more each round, once this
    // side has given up on it.
    let statement_timeout = schedule.timeout().max(Duration::from_millis(1));
    let options = Arc::new((*options).clone().options([(
        "statement_timeout",
        format!("{}ms", statement_timeout.as_millis()),
    )]));
    watch(
        schedule,
        || attempt(options.clone()),
        |round| report(reporter.clone(), round),
    )
    .await
}

/// Why one attempt failed.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("the database is read-only (a standby?): writes would fail")]
    ReadOnly,
}

/// One attempt: connect, look the absent key up, disconnect.
async fn attempt(options: Arc<PgConnectOptions>) -> Result<(), AttemptError> {
    let mut connection = options.connect().await?;
    let row = sqlx::raw_sql(PROBE).fetch_one(&mut connection).await?;
    let read_only: String = sqlx::Row::try_get(&row, "read_only")?;
    connection.close().await?;
    match read_only.as_str() {
        "off" => Ok(()),
        _ => Err(AttemptError::ReadOnly),
    }
}

/// Publishes a round: the gauges, a log line on a change, the health status.
async fn report(reporter: HealthReporter, round: Round) {
    let up = round.result.is_ok();
    metrics::gauge!(DATABASE_UP).set(if up { 1.0 } else { 0.0 });
    metrics::histogram!(DATABASE_PROBE_DURATION_SECONDS).record(round.elapsed.as_secs_f64());
    let result = match &round.result {
        Ok(()) => "success",
        Err(failure) => failure.label(),
    };
    metrics::counter!(DATABASE_PROBES_TOTAL, "result" => result).increment(1);
    if !round.changed {
        return;
    }
    match &round.result {
        Ok(()) => {
            tracing::info!(elapsed = ?round.elapsed, "database answers: SERVING");
            set(&reporter, ServingStatus::Serving).await;
        }
        Err(failure) => {
            tracing::warn!(error = %failure, "database does not answer: NOT_SERVING");
            set(&reporter, ServingStatus::NotServing).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    const I: Duration = Duration::from_millis(1000);

    /// What the fake database does from a moment on.
    #[derive(Debug, Clone, Copy)]
    enum Db {
        /// Answers after this long.
        Answers(Duration),
        /// Holds every attempt until the next change (frozen, locked).
        Hangs,
        /// Fails every attempt at once (refused, out of slots).
        Refuses,
    }

    /// A fake database following `timeline` (offsets from `start`), and the
    /// rounds reported, with when they were.
    struct Fake {
        start: Instant,
        timeline: Vec<(Duration, Db)>,
        rounds: Mutex<Vec<(Duration, Round)>>,
        attempts_in_flight: Mutex<usize>,
    }

    impl Fake {
        fn new(timeline: Vec<(Duration, Db)>) -> Arc<Self> {
            Arc::new(Self {
                start: Instant::now(),
                timeline,
                rounds: Mutex::default(),
                attempts_in_flight: Mutex::default(),
            })
        }

        /// The state at `at` and when it ends.
        fn state(&self, at: Duration) -> (Db, Option<Duration>) {
            let index = self
                .timeline
                .iter()
                .rposition(|(from, _)| *from <= at)
                .expect("the timeline starts at 0");
            (
                self.timeline[index].1,
                self.timeline.get(index + 1).map(|(from, _)| *from),
            )
        }

        async fn attempt(self: Arc<Self>) -> Result<(), String> {
            {
                let mut in_flight = self.attempts_in_flight.lock().unwrap();
                *in_flight += 1;
                assert_eq!(*in_flight, 1, "attempts overlap");
            }
            let _done = scopeguard(&self);
            loop {
                let now = self.start.elapsed();
                match self.state(now) {
                    (Db::Answers(latency), _) => {
                        tokio::time::sleep(latency).await;
                        return Ok(());
                    }
                    (Db::Refuses, _) => return Err("connection refused".into()),
                    (Db::Hangs, Some(until)) => {
                        tokio::time::sleep_until(self.start + until).await;
                    }
                    (Db::Hangs, None) => std::future::pending::<()>().await,
                }
            }
        }

        /// Runs the watcher for `run`, then the rounds reported.
        async fn run(self: &Arc<Self>, run: Duration) -> Vec<(Duration, Round)> {
            let fake = self.clone();
            let reported = self.clone();
            let watcher = watch(
                Schedule::new(I),
                move || fake.clone().attempt(),
                move |round| {
                    let reported = reported.clone();
                    async move {
                        let at = reported.start.elapsed();
                        reported.rounds.lock().unwrap().push((at, round));
                    }
                },
            );
            let _ = tokio::time::timeout(run, watcher).await;
            self.rounds.lock().unwrap().clone()
        }
    }

    /// Decrements the attempt count when an attempt ends or is dropped.
    fn scopeguard(fake: &Arc<Fake>) -> impl Drop + '_ {
        struct Guard<'a>(&'a Fake);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                *self.0.attempts_in_flight.lock().unwrap() -= 1;
            }
        }
        Guard(fake)
    }

    /// When the reported status first became `up` at or after `from`.
    fn first(rounds: &[(Duration, Round)], up: bool, from: Duration) -> Option<Duration> {
        rounds
            .iter()
            .find(|(at, round)| *at >= from && round.result.is_ok() == up)
            .map(|(at, _)| *at)
    }

    const HEALTHY: Db = Db::Answers(Duration::from_millis(5));

    /// Outages that begin at every tenth of an interval, so every phase
    /// against the probe's schedule is tried.
    fn phases() -> impl Iterator<Item = Duration> {
        (0..20).map(|tenth| 3 * I + I * tenth / 10)
    }

    #[tokio::test(start_paused = true)]
    async fn a_database_that_hangs_is_reported_down_within_one_and_a_half_intervals() {
        for fault in phases() {
            let fake = Fake::new(vec![(Duration::ZERO, HEALTHY), (fault, Db::Hangs)]);

            let rounds = fake.run(fault + 3 * I).await;

            let down = first(&rounds, false, Duration::ZERO).expect("reported down");
            assert!(
                down >= fault,
                "down at {down:?}, before the fault at {fault:?}"
            );
            assert!(
                down - fault <= I * 3 / 2,
                "fault at {fault:?}, NOT_SERVING only at {down:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_database_that_refuses_is_reported_down_within_one_and_a_half_intervals() {
        for fault in phases() {
            let fake = Fake::new(vec![(Duration::ZERO, HEALTHY), (fault, Db::Refuses)]);

            let rounds = fake.run(fault + 3 * I).await;

            let down = first(&rounds, false, Duration::ZERO).expect("reported down");
            assert!(
                down - fault <= I * 3 / 2,
                "fault at {fault:?}, down at {down:?}"
            );
            let (_, round) = rounds.iter().find(|(at, _)| *at == down).unwrap();
            assert_eq!(
                round.result,
                Err(ProbeFailure::Error("connection refused".into()))
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_database_back_from_any_outage_is_reported_up_within_one_interval_and_stays_up() {
        for outage in [Db::Hangs, Db::Refuses] {
            for back in phases() {
                let fake = Fake::new(vec![
                    (Duration::ZERO, HEALTHY),
                    (I, outage),
                    (back, HEALTHY),
                ]);

                let rounds = fake.run(back + 10 * I).await;

                let up = first(&rounds, true, back).expect("reported up again");
                assert!(up - back <= I, "{outage:?} until {back:?}, up at {up:?}");
                assert_eq!(
                    first(&rounds, false, up),
                    None,
                    "{outage:?} until {back:?}: NOT_SERVING after the recovery"
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_answer_within_half_an_interval_keeps_the_database_up() {
        let fake = Fake::new(vec![(Duration::ZERO, Db::Answers(I * 2 / 5))]);

        let rounds = fake.run(20 * I).await;

        assert!(rounds.len() >= 19, "{rounds:?}");
        assert!(rounds.iter().all(|(_, round)| round.result.is_ok()));
        assert!(rounds[0].1.changed);
        assert!(rounds[1..].iter().all(|(_, round)| !round.changed));
    }

    #[tokio::test(start_paused = true)]
    async fn one_refused_connection_is_retried_within_the_round() {
        // From the start of a round, shorter than the pause before a retry.
        let blip = 5 * I;
        let fake = Fake::new(vec![
            (Duration::ZERO, HEALTHY),
            (blip, Db::Refuses),
            (blip + I / 20, HEALTHY),
        ]);

        let rounds = fake.run(10 * I).await;

        assert_eq!(first(&rounds, false, Duration::ZERO), None, "{rounds:?}");
        let (_, retried) = rounds
            .iter()
            .find(|(at, round)| *at - round.elapsed == blip)
            .expect("a round began with the refusal");
        assert!(retried.elapsed > I / 10, "{retried:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn rounds_start_every_interval_while_up_and_every_half_interval_while_down() {
        let fake = Fake::new(vec![(Duration::ZERO, HEALTHY), (5 * I, Db::Refuses)]);

        let rounds = fake.run(10 * I).await;

        let starts: Vec<Duration> = rounds
            .iter()
            .map(|(at, round)| *at - round.elapsed)
            .collect();
        let gaps: Vec<Duration> = starts.windows(2).map(|pair| pair[1] - pair[0]).collect();
        assert!(gaps[..4].iter().all(|gap| *gap == I), "{gaps:?}");
        assert!(gaps[5..].iter().all(|gap| *gap == I / 2), "{gaps:?}");
    }
}
