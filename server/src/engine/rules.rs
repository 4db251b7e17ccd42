//! The engine's decisions, apart from I/O: each takes what a statement
//! returned or a read found and says what to answer or do next. The shell
//! in [`super`] runs the statements around them; the tests below build rows
//! in memory.

use std::time::Duration;

use super::LeaseTimes;
use crate::{
    domain::{
        AcquireOutcome, FencingToken, Fingerprint, Record, RecordId, RecordState, StoredResponse,
        Timestamp,
    },
    error::Error,
    store::{AcquiredRow, FinishInput, RecordRow, StoreError},
};

/// Longest `retry_after` hint: most attempts finish long before their lease ends.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(1);

/// What an Acquire does about the record its insert-or-read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Decision {
    /// Answer with this outcome (a finished record's is also kept for replays).
    Answer(AcquireOutcome),
    /// Expired, released, or a lapsed lease: take the record over.
    TakeOver,
}

/// Decides an Acquire on an existing record. An expired record acts as
/// absent, whatever its fingerprint; otherwise the fingerprint wins over
/// every state; then the state decides.
pub(super) fn decide(row: &RecordRow, fingerprint: &Fingerprint) -> Result<Decision, Error> {
    if row.is_expired() {
        return Ok(Decision::TakeOver);
    }
    if row.fingerprint().conflicts_with(fingerprint) {
        return Ok(Decision::Answer(AcquireOutcome::FingerprintMismatch));
    }
    Ok(match row.state()? {
        RecordState::InProgress if row.lease_is_live() => Decision::Answer(in_progress(row)),
        RecordState::Completed => Decision::Answer(AcquireOutcome::Completed {
            response: stored_response(row)?,
            completed_at: finished_at(row)?,
        }),
        RecordState::Failed => Decision::Answer(AcquireOutcome::Failed {
            error_response: stored_response(row)?,
            failed_at: finished_at(row)?,
        }),
        // The lease passed or the key was released.
        RecordState::InProgress | RecordState::Released => Decision::TakeOver,
    })
}

/// A lease a statement wrote is counted from the statement's start. One that
/// took long (a batched insert waits for any of its keys another transaction
/// is writing; a commit can stall; a batch's later rounds keep its earlier
/// ones waiting) may answer with a lease that has passed, or nearly, and the
/// key is then free to take over while this caller runs. Fresh while under
/// half the lease has gone since the statement was sent.
pub(super) fn still_fresh(lease: Duration, since_sent: Duration) -> bool {
    since_sent < lease / 2
}

/// What a guarded statement that matched no row means, once the record is
/// read (absent or expired: not found; another token: stale; then the
/// record's state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Miss<T> {
    /// The record changed between the statement and the read (cleanup, a
    /// lease passing): run the statement again.
    Again,
    /// The call is answered after all: it repeats one that succeeded.
    Answer(T),
}

/// Why a Complete or terminal Fail matched no row. A repeat with the
/// identical response is answered with the first one's time.
pub(super) fn finish_miss(
    row: Option<&RecordRow>,
    input: &FinishInput,
) -> Result<Miss<Timestamp>, Error> {
    let row = held_with(row, input.fencing_token)?;
    match row.state()? {
        RecordState::InProgress => Ok(Miss::Again),
        state @ RecordState::Released => Err(Error::NotInProgress {
            state: state.as_str(),
        }),
        state @ (RecordState::Completed | RecordState::Failed) => {
            if state == input.state && row.response()?.as_ref() == Some(&input.response) {
                return Ok(Miss::Answer(finished_at(row)?));
            }
            Err(Error::ResponseConflict {
                state: state.as_str(),
            })
        }
    }
}

/// Why a retryable Fail (a release) matched no row. A repeated release is
/// answered `Released`.
pub(super) fn release_miss(
    row: Option<&RecordRow>,
    fencing_token: FencingToken,
) -> Result<Miss<RecordState>, Error> {
    let row = held_with(row, fencing_token)?;
    match row.state()? {
        RecordState::Released => Ok(Miss::Answer(RecordState::Released)),
        state @ (RecordState::Completed | RecordState::Failed) => Err(Error::NotInProgress {
            state: state.as_str(),
        }),
        RecordState::InProgress => Ok(Miss::Again),
    }
}

/// Why a Renew matched no row. Never an answer: no Renew repeats one that
/// succeeded without renewing again.
pub(super) fn renew_miss<T>(
    row: Option<&RecordRow>,
    fencing_token: FencingToken,
) -> Result<Miss<T>, Error> {
    let row = held_with(row, fencing_token)?;
    match row.state()? {
        RecordState::InProgress => Ok(Miss::Again),
        state => Err(Error::NotInProgress {
            state: state.as_str(),
        }),
    }
}

/// The live record as Get answers it.
pub(super) fn record(id: &RecordId, row: Option<&RecordRow>) -> Result<Record, Error> {
    let row = live(row)?;
    Ok(Record {
        id: id.clone(),
        state: row.state()?,
        fingerprint: row.fingerprint(),
        fencing_token: row.fencing_token(),
        created_at: row.created_at,
        expires_at: row.expires_at,
        lease_expires_at: row.lease_expires_at,
        completed_at: row.completed_at,
        response: row.response()?,
    })
}

/// The record as read, unless absent or expired (an expired row acts as
/// absent until cleanup removes it).
fn live(row: Option<&RecordRow>) -> Result<&RecordRow, Error> {
    row.filter(|row| !row.is_expired()).ok_or(Error::NotFound)
}

/// The live record, checked to be held with `fencing_token`.
fn held_with(row: Option<&RecordRow>, fencing_token: FencingToken) -> Result<&RecordRow, Error> {
    let row = live(row)?;
    if row.fencing_token() != fencing_token {
        return Err(Error::StaleToken {
            given: fencing_token,
            current: row.fencing_token(),
        });
    }
    Ok(row)
}

pub(super) fn acquired(row: AcquiredRow) -> AcquireOutcome {
    AcquireOutcome::Acquired {
        fencing_token: row.fencing_token(),
        lease_expires_at: row.lease_expires_at,
        expires_at: row.expires_at,
        takeover: row.took_over_lapsed_lease(),
    }
}

fn in_progress(row: &RecordRow) -> AcquireOutcome {
    let lease_expires_at = row.lease_expires_at.unwrap_or(row.db_now);
    let remaining = (lease_expires_at - row.db_now).to_std().unwrap_or_default();
    AcquireOutcome::InProgress {
        lease_expires_at,
        retry_after: remaining.min(MAX_RETRY_AFTER),
    }
}

fn stored_response(row: &RecordRow) -> Result<StoredResponse, Error> {
    row.response()?
        .ok_or_else(|| StoreError::Corrupt("finished record without a response".into()).into())
}

fn finished_at(row: &RecordRow) -> Result<Timestamp, Error> {
    row.completed_at
        .ok_or_else(|| StoreError::Corrupt("finished record without completed_at".into()).into())
}

/// The lease a renewal wrote.
pub(super) fn lease_times((lease_expires_at, expires_at): (Timestamp, Timestamp)) -> LeaseTimes {
    LeaseTimes {
        lease_expires_at,
        expires_at,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use chrono::TimeZone;
    use sqlx::types::Json;

    use super::*;

    const TOKEN: FencingToken = 7;

    fn now() -> Timestamp {
        chrono::Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap()
    }

    fn secs(seconds: i64) -> chrono::Duration {
        chrono::Duration::seconds(seconds)
    }

    fn millis(milliseconds: i64) -> chrono::Duration {
        chrono::Duration::milliseconds(milliseconds)
    }

    fn fingerprint(bytes: &[u8]) -> Fingerprint {
        Fingerprint::parse("fingerprint", bytes.to_vec()).unwrap()
    }

    fn response(status_code: u32) -> StoredResponse {
        StoredResponse {
            status_code,
            body: b"{\"id\":1}".to_vec(),
            headers: BTreeMap::from([("content-type".into(), "application/json".into())]),
        }
    }

    /// A live record read at `now()`, in `state`, held with [`TOKEN`] for
    /// the fingerprint `fp`: in progress with 30 s of lease left, finished
    /// ten seconds ago with `response(201)`, or released.
    fn row(state: RecordState) -> RecordRow {
        let finished = matches!(state, RecordState::Completed | RecordState::Failed);
        let stored = response(201);
        RecordRow {
            state: state.as_str().into(),
            fingerprint: b"fp".to_vec(),
            fencing_token: TOKEN as i64,
            created_at: now() - secs(60),
            expires_at: now() + secs(3600),
            lease_expires_at: (state == RecordState::InProgress).then(|| now() + secs(30)),
            completed_at: finished.then(|| now() - secs(10)),
            response_status: finished.then_some(201),
            response_body: finished.then(|| stored.body.clone()),
            response_headers: finished.then(|| Json(stored.headers.clone())),
            db_now: now(),
        }
    }

    fn expired(row: RecordRow) -> RecordRow {
        RecordRow {
            expires_at: now(),
            ..row
        }
    }

    fn lease_left(row: RecordRow, left: chrono::Duration) -> RecordRow {
        RecordRow {
            lease_expires_at: Some(now() + left),
            ..row
        }
    }

    fn finish(state: RecordState, response: StoredResponse) -> FinishInput {
        FinishInput {
            id: RecordId::parse(
                "id",
                "payments".into(),
                "POST /payments".into(),
                String::new(),
                "key-00000001".into(),
            )
            .unwrap(),
            fencing_token: TOKEN,
            state,
            response,
        }
    }

    /// The error's kind and its words, to compare in tables.
    fn error<T: std::fmt::Debug>(result: Result<T, Error>) -> String {
        let error = result.expect_err("should fail");
        format!("{error:?}")
    }

    #[test]
    fn acquire_decisions() {
        use AcquireOutcome::{Completed, Failed, FingerprintMismatch};
        use RecordState::{Completed as Done, Failed as Failing, InProgress, Released};
        let completed = Completed {
            response: response(201),
            completed_at: now() - secs(10),
        };
        let failed = Failed {
            error_response: response(201),
            failed_at: now() - secs(10),
        };
        let in_progress = |left: chrono::Duration, retry_after: Duration| {
            Decision::Answer(AcquireOutcome::InProgress {
                lease_expires_at: now() + left,
                retry_after,
            })
        };
        let answer = Decision::Answer;
        #[rustfmt::skip]
        let cases: Vec<(&str, RecordRow, &[u8], Decision)> = vec![
            ("live lease", row(InProgress), b"fp", in_progress(secs(30), Duration::from_secs(1))),
            ("live lease, under a second left", lease_left(row(InProgress), millis(300)), b"fp",
                in_progress(millis(300), Duration::from_millis(300))),
            ("lapsed lease", lease_left(row(InProgress), secs(0)), b"fp", Decision::TakeOver),
            ("released", row(Released), b"fp", Decision::TakeOver),
            ("completed", row(Done), b"fp", answer(completed.clone())),
            ("failed", row(Failing), b"fp", answer(failed)),
            ("no fingerprint given", row(Done), b"", answer(completed)),
            ("other fingerprint, completed", row(Done), b"other", answer(FingerprintMismatch)),
            ("other fingerprint, held", row(InProgress), b"other", answer(FingerprintMismatch)),
            ("other fingerprint, released", row(Released), b"other", answer(FingerprintMismatch)),
            ("expired, completed", expired(row(Done)), b"fp", Decision::TakeOver),
            ("expired, other fingerprint", expired(row(Done)), b"other", Decision::TakeOver),
            ("expired, live lease", expired(row(InProgress)), b"fp", Decision::TakeOver),
        ];
        for (case, row, given, expected) in cases {
            assert_eq!(
                decide(&row, &fingerprint(given)).unwrap(),
                expected,
                "{case}"
            );
        }
    }

    #[test]
    fn a_finished_record_without_its_response_or_time_is_corrupt() {
        let no_response = RecordRow {
            response_status: None,
            ..row(RecordState::Completed)
        };
        let no_time = RecordRow {
            completed_at: None,
            ..row(RecordState::Failed)
        };
        let unknown = RecordRow {
            state: "paused".into(),
            ..row(RecordState::InProgress)
        };
        for (case, row) in [
            ("response", no_response),
            ("time", no_time),
            ("state", unknown),
        ] {
            let error = error(decide(&row, &fingerprint(b"fp")));
            assert!(error.contains("Corrupt"), "{case}: {error}");
        }
    }

    #[test]
    fn a_lease_is_fresh_while_under_half_of_it_has_passed() {
        let lease = Duration::from_secs(10);
        for (since_sent, fresh) in [(0, true), (4_999, true), (5_000, false), (12_000, false)] {
            assert_eq!(
                still_fresh(lease, Duration::from_millis(since_sent)),
                fresh,
                "{since_sent} ms"
            );
        }
    }

    #[test]
    fn finish_misses() {
        use RecordState::{Completed, Failed, InProgress, Released};
        let err = |error: Error| format!("{:?}", Err::<(), _>(error));
        let done = format!("{:?}", Ok::<_, ()>(Miss::Answer(now() - secs(10))));
        let conflict = |state| err(Error::ResponseConflict { state });
        let taken_over = RecordRow {
            fencing_token: TOKEN as i64 + 1,
            ..row(Completed)
        };
        let stale = err(Error::StaleToken {
            given: TOKEN,
            current: TOKEN + 1,
        });
        let complete = || finish(Completed, response(201));
        // (case, the record as read, the call, its answer)
        #[rustfmt::skip]
        let cases: Vec<(&str, Option<RecordRow>, FinishInput, String)> = vec![
            ("still held: changed meanwhile", Some(row(InProgress)), complete(), "Ok(Again)".into()),
            ("a repeated Complete", Some(row(Completed)), complete(), done.clone()),
            ("a repeated terminal Fail", Some(row(Failed)), finish(Failed, response(201)), done),
            ("another response", Some(row(Completed)), finish(Completed, response(500)), conflict("completed")),
            ("Fail after Complete", Some(row(Completed)), finish(Failed, response(201)), conflict("completed")),
            ("Complete after Fail", Some(row(Failed)), complete(), conflict("failed")),
            ("released", Some(row(Released)), complete(), err(Error::NotInProgress { state: "released" })),
            ("absent", None, complete(), err(Error::NotFound)),
            ("expired", Some(expired(row(Completed))), complete(), err(Error::NotFound)),
            ("taken over", Some(taken_over), complete(), stale),
        ];
        for (case, row, input, expected) in cases {
            let found = finish_miss(row.as_ref(), &input);
            assert_eq!(format!("{found:?}"), expected, "{case}");
        }
    }

    #[test]
    fn release_and_renew_misses() {
        use RecordState::{Completed, Failed, InProgress, Released};
        let err = |error: Error| format!("{:?}", Err::<(), _>(error));
        let not_in_progress = |state| err(Error::NotInProgress { state });
        let stale = err(Error::StaleToken {
            given: TOKEN,
            current: TOKEN + 1,
        });
        let taken_over = RecordRow {
            fencing_token: TOKEN as i64 + 1,
            ..row(InProgress)
        };
        let again = "Ok(Again)".to_owned();
        // (case, the record as read, release's answer, renew's answer)
        #[rustfmt::skip]
        let cases: Vec<(&str, Option<RecordRow>, String, String)> = vec![
            ("still held: changed meanwhile", Some(row(InProgress)), again.clone(), again),
            ("released", Some(row(Released)), "Ok(Answer(Released))".into(), not_in_progress("released")),
            ("completed", Some(row(Completed)), not_in_progress("completed"), not_in_progress("completed")),
            ("failed", Some(row(Failed)), not_in_progress("failed"), not_in_progress("failed")),
            ("taken over", Some(taken_over), stale.clone(), stale),
            ("absent", None, err(Error::NotFound), err(Error::NotFound)),
            ("expired", Some(expired(row(InProgress))), err(Error::NotFound), err(Error::NotFound)),
        ];
        for (case, row, release, renew) in cases {
            let released = release_miss(row.as_ref(), TOKEN);
            assert_eq!(format!("{released:?}"), release, "release: {case}");
            let renewed = renew_miss::<()>(row.as_ref(), TOKEN);
            assert_eq!(format!("{renewed:?}"), renew, "renew: {case}");
        }
    }

    #[test]
    fn get_answers_live_records_only() {
        let id = finish(RecordState::Completed, response(201)).id;
        let found = record(&id, Some(&row(RecordState::Completed))).unwrap();
        assert_eq!(found.state, RecordState::Completed);
        assert_eq!(found.response, Some(response(201)));
        assert_eq!(found.fencing_token, TOKEN);
        for row in [None, Some(expired(row(RecordState::Completed)))] {
            assert!(matches!(record(&id, row.as_ref()), Err(Error::NotFound)));
        }
    }

    #[test]
    fn an_acquired_row_answers_with_its_lease_and_whether_it_took_over() {
        let row = AcquiredRow::inserted(TOKEN as i64, now() + secs(60), now() + secs(3600));
        assert_eq!(
            acquired(row),
            AcquireOutcome::Acquired {
                fencing_token: TOKEN,
                lease_expires_at: now() + secs(60),
                expires_at: now() + secs(3600),
                takeover: false,
            }
        );
    }
}
