//! The replay cache: repeated Acquires of a finished record are answered
//! from memory, with the same answers the database would give, never after
//! the record expired, and an operator's purge is seen within the cache's
//! max age, by every replica.

use std::time::{Duration, Instant};

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_server::settings::{AdminCommand, Settings};
use idempotency_tests::{
    TestDb, http_get, metric_value, record_id, response, server_behind_proxy,
    server_behind_proxy_with, spawn_app, spawn_app_with, test_settings, unique_key,
};
use tonic::Code;

use crate::{replicas::Replicas, support::*};

/// The test settings have the cache on, as served by default: these turn it off.
fn without_cache(db: &TestDb) -> Settings {
    Settings {
        replay_cache_bytes: 0,
        ..test_settings(db)
    }
}

/// A record completed with `body`, then replayed once so the cache holds it.
async fn completed_and_replayed(client: &mut Client, label: &str, body: &str) -> pb::RecordId {
    let id = record_id(&unique_key(label));
    let t = token(&acquire(client, &id, b"fp").await);
    complete(client, &id, t, response(201, body)).await.unwrap();
    assert!(matches!(
        acquire(client, &id, b"fp").await,
        Outcome::Completed(_)
    ));
    id
}

#[tokio::test]
async fn a_finished_record_is_replayed_from_memory_even_while_the_database_is_down() {
    let db = TestDb::new().await;
    let (server, proxy) = server_behind_proxy(&db).await;
    let mut client = server.client.clone();
    let done = completed_and_replayed(&mut client, "cached", "{\"id\":7}").await;
    let failed = record_id(&unique_key("cached-failed"));
    let t = token(&acquire(&mut client, &failed, b"fp").await);
    fail(
        &mut client,
        &failed,
        t,
        false,
        Some(response(402, "declined")),
    )
    .await
    .unwrap();
    assert!(matches!(
        acquire(&mut client, &failed, b"fp").await,
        Outcome::Failed(_)
    ));

    proxy.cut().await;

    // The same answers as from the database: the response, the stored
    // error, and the fingerprint rule.
    match acquire(&mut client, &done, b"fp").await {
        Outcome::Completed(completed) => {
            assert_eq!(completed.response, Some(response(201, "{\"id\":7}")));
            assert!(completed.completed_at.is_some());
        }
        other => panic!("expected COMPLETED, got {other:?}"),
    }
    match acquire(&mut client, &failed, b"fp").await {
        Outcome::Failed(failed) => {
            assert_eq!(failed.error_response, Some(response(402, "declined")))
        }
        other => panic!("expected FAILED, got {other:?}"),
    }
    assert!(matches!(
        acquire(&mut client, &done, b"another request").await,
        Outcome::FingerprintMismatch(_)
    ));
    // Anything else still needs the database.
    let fresh = record_id(&unique_key("uncached"));
    let unavailable = try_acquire(&mut client, &fresh, b"fp").await;
    assert_error(unavailable, Code::Unavailable, "DATABASE_UNAVAILABLE");
}

#[tokio::test]
async fn lookups_are_counted_as_hits_and_misses() {
    let mut app = spawn_app().await;
    // Acquire of a new key, then the first replay (read from the database,
    // then cached): two misses; the second replay: a hit.
    let done = completed_and_replayed(&mut app.client, "counted", "{}").await;
    assert!(matches!(
        acquire(&mut app.client, &done, b"fp").await,
        Outcome::Completed(_)
    ));
    let page = http_get(app.server.metrics_addr, "/metrics").await;
    let lookups = |result: &str| {
        metric_value(
            &page,
            &format!("idempotency_replay_cache_lookups_total{{result=\"{result}\"}}"),
        )
    };
    assert_eq!((lookups("hit"), lookups("miss")), (Some(1.0), Some(2.0)));
}

#[tokio::test]
async fn without_the_cache_every_replay_reads_the_database() {
    let db = TestDb::new().await;
    let (server, proxy) = server_behind_proxy_with(&db, without_cache(&db)).await;
    let mut client = server.client.clone();
    let done = completed_and_replayed(&mut client, "uncached", "{}").await;
    proxy.cut().await;
    let unavailable = try_acquire(&mut client, &done, b"fp").await;
    assert_error(unavailable, Code::Unavailable, "DATABASE_UNAVAILABLE");
}

#[tokio::test]
async fn a_cached_record_is_never_replayed_after_it_expires() {
    let mut app = spawn_app_with(|settings| {
        settings.replay_cache_max_age = Duration::from_secs(3600);
    })
    .await;
    let id = record_id(&unique_key("cached-ttl"));
    let request = pb::AcquireRequest {
        id: Some(id.clone()),
        fingerprint: b"fp".to_vec(),
        ttl: Some(idempotency_tests::seconds(2)),
        // A record never expires under a live lease: keep it shorter.
        lease: Some(idempotency_tests::seconds(1)),
    };
    let t = token(&acquire_request(&mut app.client, request.clone()).await);
    complete(&mut app.client, &id, t, response(201, "{}"))
        .await
        .unwrap();
    assert!(matches!(
        acquire_request(&mut app.client, request.clone()).await,
        Outcome::Completed(_)
    ));

    wait_past(2).await;

    // Expired: a new attempt, not the cached replay.
    assert!(token(&acquire_request(&mut app.client, request).await) > t);
}

#[tokio::test]
async fn a_purge_reaches_a_replica_that_cached_the_record_within_the_max_age() {
    // Long enough that the replay right after the purge surely falls within it.
    let max_age = Duration::from_secs(3);
    let mut app = spawn_app_with(|settings| settings.replay_cache_max_age = max_age).await;
    let id = completed_and_replayed(&mut app.client, "cached-purge", "{}").await;

    run_admin(&app.db, AdminCommand::Purge(purge_args(&id)), false)
        .await
        .unwrap();

    // Until the entry's max age passes, this replica still replays...
    assert!(matches!(
        acquire(&mut app.client, &id, b"fp").await,
        Outcome::Completed(_)
    ));
    tokio::time::sleep(max_age + Duration::from_millis(200)).await;
    // ...then the key is free again: a new attempt holds it.
    token(&acquire(&mut app.client, &id, b"fp").await);
}

#[tokio::test]
async fn a_purge_stops_every_replica_replaying_the_record_within_the_max_age() {
    let max_age = Duration::from_secs(2);
    let replicas = Replicas::start(2, &["--replay-cache-max-age", "2s"]).await;
    let mut each = replicas.each().await;
    let id = record_id(&unique_key("purged-everywhere"));
    let t = token(&acquire(&mut each[0], &id, b"fp").await);
    complete(&mut each[0], &id, t, response(201, "{}"))
        .await
        .unwrap();
    // Each replica replays it twice: the first read caches it, the second
    // is answered from the cache.
    for (replica, client) in each.iter_mut().enumerate() {
        for _ in 0..2 {
            assert!(matches!(
                acquire(client, &id, b"fp").await,
                Outcome::Completed(_)
            ));
        }
        let page = replicas.metrics(replica).await;
        let hits = metric_value(
            &page,
            r#"idempotency_replay_cache_lookups_total{result="hit"}"#,
        );
        assert_eq!(hits, Some(1.0), "replica {replica}");
    }

    let purged_at = Instant::now();
    run_admin(&replicas.db, AdminCommand::Purge(purge_args(&id)), false)
        .await
        .unwrap();

    // Every replica is asked every 100 ms until past the max age. A replica
    // may answer from its cache until then (every entry was read before the
    // purge began), never after; then the key is free: one new attempt
    // holds it.
    let deadline = purged_at + max_age;
    let mut holders = 0;
    loop {
        let round_began = Instant::now();
        for (replica, client) in each.iter_mut().enumerate() {
            let asked = Instant::now();
            match acquire(client, &id, b"fp").await {
                Outcome::Completed(_) => assert!(
                    asked < deadline,
                    "replica {replica} replayed the purged record {:?} after the purge",
                    asked - purged_at
                ),
                Outcome::Acquired(_) => holders += 1,
                Outcome::InProgress(_) => {}
                other => panic!("replica {replica}: {other:?}"),
            }
        }
        if round_began > deadline {
            break; // Every replica was asked past the max age.
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(holders, 1, "one new attempt holds the purged key");
}
