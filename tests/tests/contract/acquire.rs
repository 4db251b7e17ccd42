//! Every Acquire outcome, replays, and fingerprints.

use idempotency_client::pb::acquire_response::Outcome;
use idempotency_tests::{record_id, response, spawn_app, unique_key};

use crate::{replicas::Replicas, support::*};

#[tokio::test]
async fn a_new_key_is_acquired_with_a_token_and_a_lease_inside_its_lifetime() {
    let mut app = spawn_app().await;

    let outcome = acquire(&mut app.client, &record_id(&unique_key("new")), b"fp").await;

    let Outcome::Acquired(acquired) = outcome else {
        panic!("{outcome:?}")
    };
    assert!(acquired.fencing_token > 0);
    let lease = acquired.lease_expires_at.unwrap();
    let expires = acquired.expires_at.unwrap();
    // Defaults: a 60 s lease inside a 24 h lifetime.
    assert_eq!(expires.seconds - lease.seconds, 24 * 3600 - 60);
}

#[tokio::test]
async fn a_held_key_is_in_progress_at_once_with_a_bounded_retry_hint() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("held"));
    let Outcome::Acquired(first) = acquire(&mut app.client, &id, b"fp").await else {
        panic!()
    };

    let outcome = acquire(&mut app.client, &id, b"fp").await;

    let Outcome::InProgress(in_progress) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(in_progress.lease_expires_at, first.lease_expires_at);
    let retry_after = in_progress.retry_after.unwrap();
    assert!(
        retry_after.seconds <= 1 && (retry_after.seconds, retry_after.nanos) != (0, 0),
        "{retry_after:?}"
    );
}

#[tokio::test]
async fn a_completed_key_replays_status_body_and_headers_byte_for_byte() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("replay"));
    let token = token(&acquire(&mut app.client, &id, b"fp").await);
    let mut stored = response(201, "");
    stored.body = (0..=255u8).collect(); // Not UTF-8: bytes must come back as they went in.
    stored.headers.insert("x-unicode".into(), "naïve ✓".into());
    let completed = complete(&mut app.client, &id, token, stored.clone())
        .await
        .unwrap();

    for _ in 0..3 {
        let outcome = acquire(&mut app.client, &id, b"fp").await;
        let Outcome::Completed(replay) = outcome else {
            panic!("{outcome:?}")
        };
        assert_eq!(replay.response.as_ref(), Some(&stored));
        assert_eq!(replay.completed_at, completed.completed_at);
    }
}

#[tokio::test]
async fn a_terminally_failed_key_replays_the_stored_error() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("failed"));
    let token = token(&acquire(&mut app.client, &id, b"fp").await);
    let error = response(402, r#"{"error":"card declined"}"#);
    fail(&mut app.client, &id, token, false, Some(error.clone()))
        .await
        .unwrap();

    let outcome = acquire(&mut app.client, &id, b"fp").await;

    let Outcome::Failed(failed) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(failed.error_response, Some(error));
    assert!(failed.failed_at.is_some());
}

#[tokio::test]
async fn a_fingerprint_mismatch_wins_over_every_state_and_changes_nothing() {
    mismatch_wins_over_every_state(&Replicas::start(1, &[]).await).await;
}

#[tokio::test]
async fn a_fingerprint_mismatch_is_answered_alike_by_every_replica_and_changes_nothing() {
    mismatch_wins_over_every_state(&Replicas::start(2, &[]).await).await;
}

/// Records in every state, made on the first replica; another fingerprint
/// asked of each replica, before and after the first one cached the
/// finished records.
async fn mismatch_wins_over_every_state(replicas: &Replicas) {
    let mut each = replicas.each().await;
    let maker = &mut each[0];
    // One key per state the record can be in.
    let live = record_id(&unique_key("live"));
    let lapsed = record_id(&unique_key("lapsed"));
    let completed = record_id(&unique_key("completed"));
    let failed = record_id(&unique_key("failed"));
    let released = record_id(&unique_key("released"));
    token(&acquire(maker, &live, b"original").await);
    token(&acquire_leased(maker, &lapsed, b"original", 1).await);
    let t = token(&acquire(maker, &completed, b"original").await);
    complete(maker, &completed, t, response(201, "ok"))
        .await
        .unwrap();
    let t = token(&acquire(maker, &failed, b"original").await);
    fail(maker, &failed, t, false, Some(response(400, "bad")))
        .await
        .unwrap();
    let t = token(&acquire(maker, &released, b"original").await);
    fail(maker, &released, t, true, None).await.unwrap();
    wait_past(1).await; // `lapsed`'s lease has now passed: it would be taken over.

    for cached in [false, true] {
        if cached {
            // The first replica replays the finished records: from now on
            // it answers them from its replay cache, the others from the
            // database.
            for id in [&completed, &failed] {
                let replay = acquire(&mut each[0], id, b"original").await;
                assert!(
                    matches!(replay, Outcome::Completed(_) | Outcome::Failed(_)),
                    "{replay:?}"
                );
            }
        }
        for id in [&live, &lapsed, &completed, &failed, &released] {
            for (replica, client) in each.iter_mut().enumerate() {
                let before = get(client, id).await.unwrap();

                let outcome = acquire(client, id, b"different").await;

                assert!(
                    matches!(outcome, Outcome::FingerprintMismatch(_)),
                    "{} on replica {replica} (cached: {cached}): {outcome:?}",
                    id.key
                );
                assert_eq!(get(client, id).await.unwrap(), before, "{}", id.key);
            }
        }
    }
}

#[tokio::test]
async fn an_empty_fingerprint_is_never_a_mismatch() {
    let mut app = spawn_app().await;
    let stored_with_one = record_id(&unique_key("with"));
    let stored_without = record_id(&unique_key("without"));
    let t = token(&acquire(&mut app.client, &stored_with_one, b"original").await);
    complete(&mut app.client, &stored_with_one, t, response(201, "a"))
        .await
        .unwrap();
    token(&acquire(&mut app.client, &stored_without, b"").await);

    // Asking without a fingerprint replays; asking with one on a record made without is no mismatch.
    assert!(matches!(
        acquire(&mut app.client, &stored_with_one, b"").await,
        Outcome::Completed(_)
    ));
    assert!(matches!(
        acquire(&mut app.client, &stored_without, b"anything").await,
        Outcome::InProgress(_)
    ));
    assert!(matches!(
        acquire(&mut app.client, &stored_without, b"").await,
        Outcome::InProgress(_)
    ));
}

#[tokio::test]
async fn a_takeover_keeps_the_first_fingerprint() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("keep"));
    let first = token(&acquire_leased(&mut app.client, &id, b"original", 1).await);
    wait_past(1).await;

    // Taking over without a fingerprint does not erase the stored one.
    assert!(token(&acquire(&mut app.client, &id, b"").await) > first);

    assert_eq!(
        get(&mut app.client, &id).await.unwrap().fingerprint,
        b"original"
    );
    assert!(matches!(
        acquire(&mut app.client, &id, b"different").await,
        Outcome::FingerprintMismatch(_)
    ));
}
