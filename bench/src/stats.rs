//! What a run's workers measured, and the report.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use hdrhistogram::Histogram;
use idempotency_client::Error;
use serde_json::{Value, json};

/// Latencies are kept in microseconds, 1 µs to 1 h, 3 significant digits.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A run's counts: its workers' [`Recorder`]s hand theirs over.
#[derive(Debug)]
pub struct Stats {
    /// The whole operation: Acquire and, when it was granted, Complete.
    pub latency: Histogram<u64>,
    /// Acquire alone.
    pub acquire_latency: Histogram<u64>,
    /// Operations that got an answer (no error).
    pub ops: u64,
    /// Operations of the warm-up, answered or not (not measured).
    pub warmup_ops: u64,
    pub outcomes: BTreeMap<&'static str, u64>,
    /// By "rpc:code", e.g. `acquire:unavailable`.
    pub errors: BTreeMap<String, u64>,
    /// The first message seen for each error key, to tell what went wrong.
    pub error_samples: BTreeMap<String, String>,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            latency: histogram(),
            acquire_latency: histogram(),
            ops: 0,
            warmup_ops: 0,
            outcomes: BTreeMap::new(),
            errors: BTreeMap::new(),
            error_samples: BTreeMap::new(),
        }
    }
}

impl Stats {
    pub fn record_op(&mut self, outcome: &'static str, total: Duration, acquire: Duration) {
        self.ops += 1;
        self.latency.saturating_record(micros(total));
        self.acquire_latency.saturating_record(micros(acquire));
        *self.outcomes.entry(outcome).or_default() += 1;
    }

    pub fn record_error(&mut self, rpc: &str, error: &Error) {
        let key = format!("{rpc}:{}", error_code(error));
        self.error_samples
            .entry(key.clone())
            .or_insert_with(|| error.to_string());
        *self.errors.entry(key).or_default() += 1;
    }

    pub fn errors_total(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// A worker's measurements on their way to the run's one [`Stats`], a few at
/// a time under its lock. One `Stats` per worker would give each its own two
/// histograms: 184 KiB of counts each at this range and precision, 92 MiB at
/// 256 callers (10–20 MiB of it touched at their latencies), and records
/// then missed the caches: 5 % of the load generator's CPU at 256 callers went
/// to recording, and the caches it took were the server's and Postgres's too.
pub struct Recorder {
    shared: Arc<Mutex<Stats>>,
    ops: Vec<(&'static str, Duration, Duration)>,
    warmup_ops: u64,
}

impl Recorder {
    /// Operations kept before they go into the shared histograms.
    const BATCH: usize = 64;

    pub fn new(shared: Arc<Mutex<Stats>>) -> Self {
        Self {
            shared,
            ops: Vec::with_capacity(Self::BATCH),
            warmup_ops: 0,
        }
    }

    pub fn op(&mut self, outcome: &'static str, total: Duration, acquire: Duration) {
        self.ops.push((outcome, total, acquire));
        if self.ops.len() == Self::BATCH {
            self.flush();
        }
    }

    pub fn warmup_op(&mut self) {
        self.warmup_ops += 1;
    }

    pub fn error(&mut self, rpc: &str, error: &Error) {
        lock(&self.shared).record_error(rpc, error);
    }

    fn flush(&mut self) {
        let mut stats = lock(&self.shared);
        for (outcome, total, acquire) in self.ops.drain(..) {
            stats.record_op(outcome, total, acquire);
        }
        stats.warmup_ops += std::mem::take(&mut self.warmup_ops);
    }
}

/// What a worker has not yet handed over goes in when it ends.
impl Drop for Recorder {
    fn drop(&mut self) {
        self.flush();
    }
}

/// The run's stats, even if a worker panicked holding the lock (its panic is
/// reported on its own).
fn lock(stats: &Mutex<Stats>) -> MutexGuard<'_, Stats> {
    stats.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The run's stats once every [`Recorder`] handed its last over; `None`
/// while one still lives.
pub fn collected(shared: Arc<Mutex<Stats>>) -> Option<Stats> {
    Arc::into_inner(shared).map(|stats| stats.into_inner().unwrap_or_else(PoisonError::into_inner))
}

/// A short, stable name for an error of the client.
pub fn error_code(error: &Error) -> String {
    match error {
        Error::InvalidArgument { .. } => "invalid_argument".into(),
        Error::NotFound => "not_found".into(),
        Error::LeaseLost => "lease_lost".into(),
        Error::ResponseConflict => "response_conflict".into(),
        Error::NotInProgress => "not_in_progress".into(),
        // Also deadline exceeded and reset connections (the client's transient class).
        Error::Unavailable { .. } => "unavailable".into(),
        Error::Internal(_) => "internal".into(),
        Error::Config(_) => "config".into(),
        Error::Unexpected(status) => snake_case(&format!("{:?}", status.code())),
        _ => "other".into(),
    }
}

fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// Percentiles in microseconds under stable names.
pub fn percentiles(histogram: &Histogram<u64>) -> Value {
    if histogram.is_empty() {
        return json!({"p50": null, "p90": null, "p99": null, "p999": null, "max": null, "mean": null});
    }
    json!({
        "p50": histogram.value_at_quantile(0.50),
        "p90": histogram.value_at_quantile(0.90),
        "p99": histogram.value_at_quantile(0.99),
        "p999": histogram.value_at_quantile(0.999),
        "max": histogram.max(),
        "mean": (histogram.mean() * 10.0).round() / 10.0,
    })
}

/// `p50 1.23 ms  p90 …` for the human-readable report.
pub fn percentiles_line(histogram: &Histogram<u64>) -> String {
    if histogram.is_empty() {
        return "no samples".into();
    }
    let ms = |us: u64| format!("{:.3} ms", us as f64 / 1000.0);
    format!(
        "p50 {}  p90 {}  p99 {}  p99.9 {}  max {}",
        ms(histogram.value_at_quantile(0.50)),
        ms(histogram.value_at_quantile(0.90)),
        ms(histogram.value_at_quantile(0.99)),
        ms(histogram.value_at_quantile(0.999)),
        ms(histogram.max()),
    )
}

/// CPU seconds (user + system) a process has used so far, from
/// `/proc/<pid>/stat` (`self` for this one); `None` off Linux or when it is gone.
pub fn process_cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count fields after its ')'.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 here (1-based).
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // USER_HZ is 100 on every Linux ABI that matters here.
    Some((utime + stime) / 100.0)
}

/// Busy and total CPU time of the whole machine (all cores), in ticks, from `/proc/stat`.
pub fn machine_cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let ticks: Vec<u64> = line
        .split_whitespace()
        .take(8)
        .map(|t| t.parse().unwrap_or(0))
        .collect();
    let total: u64 = ticks.iter().sum();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// The busy fraction of the machine (0 to 1, all cores) between two samples.
pub fn busy_fraction(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((busy0, total0), (busy1, total1)) = (before?, after?);
    let total = total1.checked_sub(total0).filter(|t| *t > 0)?;
    Some(busy1.saturating_sub(busy0) as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_snake_case() {
        assert_eq!(snake_case("DeadlineExceeded"), "deadline_exceeded");
        assert_eq!(snake_case("Cancelled"), "cancelled");
        assert_eq!(error_code(&Error::LeaseLost), "lease_lost");
    }

    #[test]
    fn recorders_hand_over_every_operation() {
        let shared = Arc::new(Mutex::new(Stats::default()));
        let mut a = Recorder::new(shared.clone());
        let mut b = Recorder::new(shared.clone());
        for i in 0..(Recorder::BATCH as u64 * 2 + 5) {
            a.op(
                "acquired",
                Duration::from_micros(100 + i),
                Duration::from_micros(50),
            );
        }
        b.op(
            "replayed",
            Duration::from_millis(3),
            Duration::from_millis(3),
        );
        b.warmup_op();
        b.error("complete", &Error::LeaseLost);
        // Two batches from `a` are in; its last five and all of `b`'s but the
        // error come with the drops.
        assert_eq!(lock(&shared).ops, Recorder::BATCH as u64 * 2);
        assert_eq!(lock(&shared).errors["complete:lease_lost"], 1);
        drop(a);
        drop(b);
        let stats = lock(&shared);
        assert_eq!(stats.ops, Recorder::BATCH as u64 * 2 + 6);
        assert_eq!(stats.latency.len(), stats.ops);
        assert_eq!(stats.acquire_latency.len(), stats.ops);
        assert_eq!(stats.outcomes["acquired"], Recorder::BATCH as u64 * 2 + 5);
        assert_eq!(stats.outcomes["replayed"], 1);
        assert_eq!(stats.warmup_ops, 1);
        assert_eq!(stats.latency.count_at(3000), 1);
        assert_eq!(stats.errors_total(), 1);
        assert!(percentiles(&stats.latency)["max"].as_u64().unwrap() >= 2990);
    }

    #[test]
    fn cpu_time_is_readable() {
        assert!(process_cpu_seconds("self").is_some());
        assert!(machine_cpu_ticks().is_some());
        assert_eq!(busy_fraction(Some((10, 100)), Some((60, 200))), Some(0.5));
        assert_eq!(busy_fraction(Some((10, 100)), Some((10, 100))), None);
    }
}
