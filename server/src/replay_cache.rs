//! Completed and failed records, kept in memory to answer repeated Acquires
//! (a client's retries, a retry storm after an outage) without a database
//! round trip.
//!
//! Safe because a finished record never changes: nothing moves it out of
//! COMPLETED or FAILED before it expires, and an entry never outlives the
//! record's own expiry (measured against the database clock when it was
//! read). The one exception is an operator's `admin purge`, which runs
//! against the database: a replica that cached the record keeps replaying it
//! for at most `max_age`.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use quick_cache::{Weighter, sync::Cache};

use crate::{
    domain::{AcquireOutcome, Fingerprint, RecordId, Timestamp},
    metrics::REPLAY_CACHE_LOOKUPS_TOTAL,
    telemetry::MetricsRecorder,
};

/// Size and freshness of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCacheSettings {
    /// Most bytes of ids and responses held (roughly; bookkeeping is extra).
    pub max_bytes: u64,
    /// Longest an entry is used; bounds how long a purge goes unseen.
    pub max_age: Duration,
}

/// The flags' defaults (`settings.rs`'s tests keep the two equal).
impl Default for ReplayCacheSettings {
    fn default() -> Self {
        Self {
            max_bytes: 64 * 1024 * 1024,
            max_age: Duration::from_secs(10),
        }
    }
}

struct Entry {
    fingerprint: Fingerprint,
    /// `Completed` or `Failed`.
    outcome: AcquireOutcome,
    valid_until: Instant,
    /// Bytes held, computed once: the cache asks often.
    weight: u64,
}

#[derive(Clone)]
struct EntryWeight;

/// Per-entry bookkeeping (map slot, Arc, timestamps) beyond the bytes counted.
const ENTRY_OVERHEAD: u64 = 256;
/// Per-header bookkeeping (a map node, two strings' headers): a response of
/// many tiny headers weighs far more than their bytes.
const HEADER_OVERHEAD: u64 = 96;

impl Weighter<RecordId, Arc<Entry>> for EntryWeight {
    fn weight(&self, _: &RecordId, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
}

/// The cache, shared by every call of one server.
#[derive(Clone)]
pub struct ReplayCache {
    entries: Arc<Cache<RecordId, Arc<Entry>, EntryWeight>>,
    max_age: Duration,
    /// Registered once: every Acquire looks up, and most miss (new keys).
    hits: metrics::Counter,
    misses: metrics::Counter,
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("entries", &self.entries.len())
            .field("max_age", &self.max_age)
            .finish()
    }
}

impl ReplayCache {
    /// Built after the metrics recorder is installed (hence the proof): it
    /// registers its counters here, once.
    pub fn new(settings: ReplayCacheSettings, _installed: &MetricsRecorder) -> Self {
        // quick_cache sizes its table from an item estimate: assume small responses.
        let estimated_items = (settings.max_bytes / 1024).clamp(16, 1 << 20) as usize;
        Self {
            entries: Arc::new(Cache::with_weighter(
                estimated_items,
                settings.max_bytes,
                EntryWeight,
            )),
            max_age: settings.max_age,
            hits: metrics::counter!(REPLAY_CACHE_LOOKUPS_TOTAL, "result" => "hit"),
            misses: metrics::counter!(REPLAY_CACHE_LOOKUPS_TOTAL, "result" => "miss"),
        }
    }

    /// The answer to an Acquire of `id` with `fingerprint`, when the record
    /// is known to be finished and still live.
    pub fn lookup(&self, id: &RecordId, fingerprint: &Fingerprint) -> Option<AcquireOutcome> {
        let found = self
            .entries
            .get(id)
            .filter(|entry| entry.valid_until > Instant::now());
        if found.is_some() {
            &self.hits
        } else {
            &self.misses
        }
        .increment(1);
        let entry = found?;
        // The same rule as for a record read from the database: the
        // fingerprint wins over the state.
        Some(if entry.fingerprint.conflicts_with(fingerprint) {
            AcquireOutcome::FingerprintMismatch
        } else {
            entry.outcome.clone()
        })
    }

    /// Remembers a finished record that expires at `expires_at`, read by a
    /// statement that began at `db_now` on the database clock and at
    /// `sent` on ours: its lifetime counts from before the statement, so a
    /// slow statement cannot stretch it.
    pub fn remember(
        &self,
        id: &RecordId,
        fingerprint: Fingerprint,
        outcome: &AcquireOutcome,
        (db_now, sent): (Timestamp, Instant),
        expires_at: Timestamp,
    ) {
        let response = match outcome {
            AcquireOutcome::Completed { response, .. } => response,
            AcquireOutcome::Failed { error_response, .. } => error_response,
            _ => return,
        };
        // A second's margin for the clocks' granularity and the statement's
        // start on the server, so an entry never outlives its record.
        let Some(lives) = (expires_at - db_now)
            .to_std()
            .ok()
            .and_then(|lives| lives.checked_sub(Duration::from_secs(1)))
        else {
            return; // Expired, or about to.
        };
        let response_bytes =
            response.size() as u64 + HEADER_OVERHEAD * response.headers.len() as u64;
        let id_bytes =
            id.namespace().len() + id.operation().len() + id.subject().len() + id.key().len();
        let entry = Entry {
            weight: ENTRY_OVERHEAD
                + response_bytes
                + (id_bytes + fingerprint.as_bytes().len()) as u64,
            fingerprint,
            outcome: outcome.clone(),
            valid_until: sent + lives.min(self.max_age),
        };
        self.entries.insert(id.clone(), Arc::new(entry));
    }
}
