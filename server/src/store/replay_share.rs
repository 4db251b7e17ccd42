//! How often a lone Acquire finds its key already there, to choose the
//! statements it runs.
//!
//! A call alone in its statement (every call at low load) has three ways to
//! insert-or-read its record, each the cheapest for one mix of keys
//! (`statements::insert_or_read`):
//! - **insert first**: a plain insert, and only when it inserts nothing a
//!   second round trip reads the record. The least for a new key, the
//!   common call; a replay pays two statements.
//! - **read first**: one statement that reads the key and inserts only when
//!   the read found nothing. A replay pays one index probe and the
//!   statement's CTEs; a new key pays the probe beside its insert.
//! - **read, then insert**: a plain primary-key read, and only when it finds
//!   nothing a second round trip inserts (as insert first). The least for a
//!   replay; a new key pays two statements.
//!
//! Measured on this machine (`docs/performance.md`, "Reading first when
//! many keys exist" and "A plain read when most keys exist"): reading first
//! takes about 0.1 ms off a replay through Postgres and adds up to about
//! 0.03 ms to a new key, so it pays once more than about a fifth of lone
//! Acquires find their key: a deployment whose replays miss the replay
//! cache (several replicas, a restart), or whose callers retry a lot. The
//! plain read takes another 0.02–0.03 ms off a replay and adds a round trip
//! (0.05–0.08 ms net) to a new key: it pays above about 0.7 to 0.75 (with
//! three in four keys existing it measured even with reading first, with
//! nine in ten 6 % faster). Every other deployment keeps the plain insert.

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

/// The plain read pays above about 0.7 to 0.75 (see the module docs);
/// 13/16 leaves a margin for a new key's round trip, which varies more.
const READ_THEN_INSERT_ABOVE: u32 = ONE / 16 * 13;

/// Each call weighs 1/16 of the average: five replays in a row turn a
/// server that saw only new keys to reading first, twenty-six to the plain
/// read; four new keys turn a server of replays back to reading first, and
/// about twenty more to the plain insert.
const WEIGHT_SHIFT: u32 = 4;

/// The statements a lone Acquire runs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoneAcquire {
    /// A plain insert; a read only when the key exists.
    InsertFirst,
    /// One statement that reads the key and inserts only when it is absent.
    ReadFirst,
    /// A plain read; an insert (as [`Self::InsertFirst`]) only when the key
    /// is absent.
    ReadThenInsert,
}

impl ReplayShare {
    /// The statements the next lone Acquire should run.
    pub(crate) fn lone_acquire(&self) -> LoneAcquire {
        match self.0.load(Ordering::Relaxed) {
            share if share > READ_THEN_INSERT_ABOVE => LoneAcquire::ReadThenInsert,
            share if share > READ_FIRST_ABOVE => LoneAcquire::ReadFirst,
            _ => LoneAcquire::InsertFirst,
        }
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

    use LoneAcquire::*;

    #[test]
    fn a_new_server_inserts_first() {
        assert_eq!(ReplayShare::default().lone_acquire(), InsertFirst);
    }

    #[test]
    fn five_replays_in_a_row_turn_it_to_reading_first_and_twenty_six_to_the_plain_read() {
        let share = ReplayShare::default();
        observe(&share, false, 1_000);
        observe(&share, true, 4);
        assert_eq!(share.lone_acquire(), InsertFirst, "four replays");
        observe(&share, true, 1);
        assert_eq!(share.lone_acquire(), ReadFirst);
        observe(&share, true, 20);
        assert_eq!(share.lone_acquire(), ReadFirst, "twenty-five replays");
        observe(&share, true, 1);
        assert_eq!(share.lone_acquire(), ReadThenInsert);
    }

    #[test]
    fn four_new_keys_turn_it_to_reading_first_and_about_twenty_more_back() {
        let share = ReplayShare::default();
        observe(&share, true, 1_000);
        observe(&share, false, 3);
        assert_eq!(share.lone_acquire(), ReadThenInsert, "three new keys");
        observe(&share, false, 1);
        assert_eq!(share.lone_acquire(), ReadFirst);
        observe(&share, false, 17);
        assert_eq!(
            share.lone_acquire(),
            ReadFirst,
            "the average still over a quarter"
        );
        observe(&share, false, 1);
        assert_eq!(share.lone_acquire(), InsertFirst);
    }

    #[test]
    fn each_mix_of_keys_keeps_its_statements() {
        let mixes = [(10, InsertFirst), (2, ReadFirst)];
        for (every, expected) in mixes {
            let share = ReplayShare::default();
            for call in 0..1_000 {
                share.observe(call % every == 0);
                if call > 100 {
                    assert_eq!(share.lone_acquire(), expected, "1 in {every}, call {call}");
                }
            }
        }
        // Nine replays in ten: the plain read, but for a call or two after
        // each new key.
        let share = ReplayShare::default();
        let plain_reads = (0..1_000)
            .filter(|call| {
                share.observe(call % 10 != 0);
                share.lone_acquire() == ReadThenInsert
            })
            .count();
        assert!(plain_reads > 700, "{plain_reads}");
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
