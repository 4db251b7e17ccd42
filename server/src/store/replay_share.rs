//! How often a lone Acquire finds its key already there, to choose the
//! statement it runs.
//!
//! A call alone in its statement (every call at low load) has two ways to
//! insert-or-read its record, each the cheaper one for one kind of key
//! (`statements::insert_or_read`):
//! - **insert first**: a plain insert, and only when it inserts nothing a
//!   second round trip reads the record. The least for a new key, the
//!   common call; a replay pays two statements.
//! - **read first**: one statement that reads the key and inserts only when
//!   the read found nothing. A replay pays one index probe; a new key pays
//!   that probe and the statement's CTEs.
//!
//! Measured on this machine (`docs/performance.md`, "Reading first when
//! many keys exist"): reading first takes about 0.1 ms off a replay through
//! Postgres and adds up to about 0.03 ms to a new key. Reading first pays
//! once more than about a fifth of lone Acquires find their key: a
//! deployment whose replays miss the replay cache (several replicas, a
//! restart), or whose callers retry a lot. Every other deployment keeps the
//! plain insert.

use std::sync::atomic::{AtomicU32, Ordering};

/// A moving average of whether lone Acquires found their key (1) or
/// created it (0), in 16-bit fixed point.
#[derive(Debug, Default)]
pub(crate) struct ReplayShare(AtomicU32);

/// 1.0 in the average's fixed point.
const ONE: u32 = 1 << 16;

/// Reading first pays above about a fifth (see the module docs); a quarter
/// leaves a mixed workload near the break-even on the plain insert.
const READ_FIRST_ABOVE: u32 = ONE / 4;

/// Each call weighs 1/16 of the average: five replays in a row turn a
/// server that saw only new keys to reading first, and about twenty new
/// keys turn it back.
const WEIGHT_SHIFT: u32 = 4;

impl ReplayShare {
    /// Whether the next lone Acquire should read first.
    pub(crate) fn read_first(&self) -> bool {
        self.0.load(Ordering::Relaxed) > READ_FIRST_ABOVE
    }

    /// Notes what a lone Acquire's statement found.
    pub(crate) fn observe(&self, key_existed: bool) {
        // A load and a store, not a compare-and-swap loop: of two calls
        // noted at once one may be lost, which only blurs an estimate.
        let share = self.0.load(Ordering::Relaxed);
        let sample = if key_existed { ONE } else { 0 };
        // The old share's weight rounded up, so that new keys alone take
        // the average down to 0 (rounded down, it stuck at 15).
        let next = share - share.div_ceil(1 << WEIGHT_SHIFT) + (sample >> WEIGHT_SHIFT);
        self.0.store(next, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observe(share: &ReplayShare, key_existed: bool, times: usize) {
        for _ in 0..times {
            share.observe(key_existed);
        }
    }

    #[test]
    fn a_new_server_inserts_first() {
        assert!(!ReplayShare::default().read_first());
    }

    #[test]
    fn five_replays_in_a_row_turn_it_to_reading_first() {
        let share = ReplayShare::default();
        observe(&share, false, 1_000);
        observe(&share, true, 4);
        assert!(!share.read_first(), "four of the last calls replays");
        observe(&share, true, 1);
        assert!(share.read_first());
    }

    #[test]
    fn about_twenty_new_keys_turn_it_back() {
        let share = ReplayShare::default();
        observe(&share, true, 1_000);
        observe(&share, false, 21);
        assert!(share.read_first(), "the average still over a quarter");
        observe(&share, false, 1);
        assert!(!share.read_first());
    }

    #[test]
    fn a_tenth_of_replays_keeps_the_plain_insert_and_a_half_reads_first() {
        let tenth = ReplayShare::default();
        let half = ReplayShare::default();
        for call in 0..1_000 {
            tenth.observe(call % 10 == 0);
            half.observe(call % 2 == 0);
            if call > 100 {
                assert!(!tenth.read_first(), "call {call}");
                assert!(half.read_first(), "call {call}");
            }
        }
    }

    #[test]
    fn the_average_stays_within_its_bounds() {
        let share = ReplayShare::default();
        observe(&share, true, 100_000);
        assert!(share.0.load(Ordering::Relaxed) <= ONE);
        observe(&share, false, 100_000);
        assert_eq!(share.0.load(Ordering::Relaxed), 0);
    }
}
