//! Leases: a crashed holder is taken over and fenced off; a slow one renews.

use idempotency_client::pb::acquire_response::Outcome;
use idempotency_tests::{record_id, response, spawn_app, unique_key};
use tonic::Code;

use crate::{replicas::Replicas, support::*};

#[tokio::test]
async fn a_crashed_holder_is_taken_over_after_its_lease_and_cannot_complete() {
    crashed_holder_is_taken_over_and_fenced_off(&Replicas::start(1, &[]).await).await;
}

#[tokio::test]
async fn a_holder_crashed_on_one_replica_is_taken_over_on_another_and_fenced_off_on_both() {
    crashed_holder_is_taken_over_and_fenced_off(&Replicas::start(2, &[]).await).await;
}

/// The holder takes its lease on the first replica and crashes; the key is
/// taken over on the last; every replica refuses the crashed holder's token.
async fn crashed_holder_is_taken_over_and_fenced_off(replicas: &Replicas) {
    let mut each = replicas.each().await;
    let last = each.len() - 1;
    let id = record_id(&unique_key("crash"));
    let crashed = token(&acquire_leased(&mut each[0], &id, b"fp", 1).await);
    // The holder "crashes": no Complete, no Fail.
    wait_past(1).await;

    let takeover = token(&acquire(&mut each[last], &id, b"fp").await);

    // Within the record's lifetime a takeover adds one.
    assert_eq!(takeover, crashed + 1);
    for client in &mut each {
        let stale = complete(
            client,
            &id,
            crashed,
            response(201, "from the crashed holder"),
        )
        .await;
        assert_error(stale, Code::Aborted, "STALE_FENCING_TOKEN");
        let renewed = renew(client, &id, crashed, 30).await;
        assert_error(renewed, Code::Aborted, "STALE_FENCING_TOKEN");
        for retryable in [true, false] {
            let failed = fail(client, &id, crashed, retryable, None).await;
            assert_error(failed, Code::Aborted, "STALE_FENCING_TOKEN");
        }
    }
    let current = response(201, "from the new holder");
    complete(&mut each[last], &id, takeover, current.clone())
        .await
        .unwrap();
    for client in &mut each {
        let Outcome::Completed(replay) = acquire(client, &id, b"fp").await else {
            panic!()
        };
        assert_eq!(replay.response, Some(current.clone()));
        // Even after completion, the stale token stays fenced off.
        let late = complete(
            client,
            &id,
            crashed,
            response(201, "from the crashed holder"),
        )
        .await;
        assert_error(late, Code::Aborted, "STALE_FENCING_TOKEN");
    }
}

#[tokio::test]
async fn a_lapsed_lease_can_still_complete_while_nobody_took_over() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("late"));
    let t = token(&acquire_leased(&mut app.client, &id, b"fp", 1).await);
    wait_past(1).await;

    complete(&mut app.client, &id, t, response(201, "late but alone"))
        .await
        .unwrap();

    assert!(matches!(
        acquire(&mut app.client, &id, b"fp").await,
        Outcome::Completed(_)
    ));
}

#[tokio::test]
async fn renew_keeps_a_slow_holder_alive_past_its_first_lease() {
    renewals_keep_a_slow_holder_alive(&Replicas::start(1, &[]).await).await;
}

#[tokio::test]
async fn renewals_on_either_replica_keep_a_slow_holder_alive_on_both() {
    renewals_keep_a_slow_holder_alive(&Replicas::start(2, &[]).await).await;
}

/// The holder renews through each replica in turn; no replica lets another
/// caller take the key over.
async fn renewals_keep_a_slow_holder_alive(replicas: &Replicas) {
    let mut each = replicas.each().await;
    let id = record_id(&unique_key("slow"));
    let Outcome::Acquired(first) = acquire_leased(&mut each[0], &id, b"fp", 1).await else {
        panic!()
    };

    // The slow holder renews for 2 s every half second; 2.5 s later the first
    // lease is long gone, yet nobody could take over.
    let mut renewed = None;
    for round in 0..5 {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let renewer = round % each.len();
        renewed = Some(
            renew(&mut each[renewer], &id, first.fencing_token, 2)
                .await
                .unwrap(),
        );
        for client in &mut each {
            assert!(matches!(
                acquire(client, &id, b"fp").await,
                Outcome::InProgress(_)
            ));
        }
    }

    let renewed = renewed.unwrap();
    assert!(
        renewed.lease_expires_at.unwrap().seconds > first.lease_expires_at.unwrap().seconds + 1
    );
    for client in &mut each {
        assert_eq!(
            get(client, &id).await.unwrap().lease_expires_at,
            renewed.lease_expires_at
        );
    }
    let last = each.len() - 1;
    complete(
        &mut each[last],
        &id,
        first.fencing_token,
        response(201, "slow but sure"),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn renew_is_refused_for_a_stale_token_a_finished_record_and_an_unknown_key() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("renew"));
    let stale = token(&acquire_leased(&mut app.client, &id, b"fp", 1).await);
    wait_past(1).await;
    let current = token(&acquire(&mut app.client, &id, b"fp").await);

    assert_error(
        renew(&mut app.client, &id, stale, 30).await,
        Code::Aborted,
        "STALE_FENCING_TOKEN",
    );
    complete(&mut app.client, &id, current, response(200, "done"))
        .await
        .unwrap();
    assert_error(
        renew(&mut app.client, &id, current, 30).await,
        Code::FailedPrecondition,
        "NOT_IN_PROGRESS",
    );
    let unknown = record_id(&unique_key("unknown"));
    assert_error(
        renew(&mut app.client, &unknown, 1, 30).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
}

#[tokio::test]
async fn renewing_past_the_lifetime_moves_the_expiry_so_a_live_lease_never_expires() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("outlive"));
    let request = idempotency_client::pb::AcquireRequest {
        id: Some(id.clone()),
        ttl: Some(idempotency_tests::seconds(2)),
        lease: Some(idempotency_tests::seconds(1)),
        ..Default::default()
    };
    let t = token(&acquire_request(&mut app.client, request).await);

    let renewed = renew(&mut app.client, &id, t, 10).await.unwrap();

    assert!(renewed.expires_at.unwrap().seconds >= renewed.lease_expires_at.unwrap().seconds);
    wait_past(2).await; // The original lifetime has passed; the lease has not.
    assert!(matches!(
        acquire(&mut app.client, &id, b"").await,
        Outcome::InProgress(_)
    ));
}
