//! `Client::run`: the whole protocol in one call.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use idempotency_client::{
    Failure, OnUnavailable, Ran, RecordState, RunError, RunOptions, StoredResponse,
};
use idempotency_tests::spawn_app;

use crate::support::*;

type Options = RunOptions<String>;

/// A business error is terminal when it says "declined", else retryable.
fn declined_is_final() -> Options {
    RunOptions::new(|error: &String| {
        if error.contains("declined") {
            Failure::Terminal(StoredResponse::new(402, error.clone()))
        } else {
            Failure::Retryable
        }
    })
}

#[tokio::test]
async fn the_logic_runs_once_and_duplicates_replay_its_response() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("once");
    let runs = AtomicU32::new(0);
    let work = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, String>(StoredResponse::new(201, "pay_1"))
    };

    let first = client
        .run(&request, &Options::default(), |_| work())
        .await
        .unwrap();
    let second = client
        .run(&request, &Options::default(), |_| work())
        .await
        .unwrap();

    assert_eq!(first, Ran::Executed(StoredResponse::new(201, "pay_1")));
    assert_eq!(second, Ran::Replayed(StoredResponse::new(201, "pay_1")));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn business_errors_are_stored_or_released_as_classified() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let declined = request("declined");
    let flaky = request("flaky");

    let result = client
        .run(&declined, &declined_is_final(), |_| async {
            Err::<StoredResponse, _>("card declined".to_string())
        })
        .await;
    assert!(
        matches!(result, Err(RunError::Business(ref e)) if e == "card declined"),
        "{result:?}"
    );
    let retry = client
        .run(&declined, &declined_is_final(), |_| async {
            panic!("must not run again")
        })
        .await;
    assert!(
        matches!(retry, Err(RunError::PreviouslyFailed(ref r)) if r.status_code == 402),
        "{retry:?}"
    );

    let released = AtomicU64::new(0);
    let result = client
        .run(&flaky, &declined_is_final(), |attempt| {
            released.store(attempt.fencing_token.unwrap(), Ordering::SeqCst);
            async { Err::<StoredResponse, _>("timeout".to_string()) }
        })
        .await;
    assert!(matches!(result, Err(RunError::Business(_))));
    let released = released.load(Ordering::SeqCst);
    let retry = client
        .run(&flaky, &declined_is_final(), |attempt| async move {
            assert!(
                attempt.fencing_token.unwrap() > released,
                "the released key is taken over"
            );
            Ok::<_, String>(StoredResponse::new(201, "second time lucky"))
        })
        .await;
    assert!(matches!(retry, Ok(Ran::Executed(_))), "{retry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_logic_releases_the_key() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("panic");
    let held = Arc::new(AtomicU64::new(0));

    let panicked = tokio::spawn({
        let client = client.clone();
        let request = request.clone();
        let held = held.clone();
        async move {
            client
                .run(&request, &Options::default(), |attempt| async move {
                    held.store(attempt.fencing_token.unwrap(), Ordering::SeqCst);
                    panic!("bug in the handler")
                })
                .await
        }
    })
    .await;

    assert!(panicked.unwrap_err().is_panic());
    wait_for_state(&client, &request.id, RecordState::Released).await;
    let lease = proceed(&client, &request).await;
    assert!(lease.fencing_token() > held.load(Ordering::SeqCst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_releases_the_key() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("cancelled");

    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let held = AtomicU64::new(0);

    // Cancel once the logic is running (so Acquire is done), as a client hang-up would.
    let options = Options::default();
    let cancelled = tokio::time::timeout(Duration::from_secs(10), async {
        let run = client.run(&request, &options, |attempt| {
            let started = started.clone();
            held.store(attempt.fencing_token.unwrap(), Ordering::SeqCst);
            async move {
                started.notify_one();
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok(StoredResponse::new(201, "never"))
            }
        });
        tokio::select! {
            result = run => Some(result),
            () = started.notified() => None,
        }
    })
    .await
    .unwrap();

    assert!(cancelled.is_none(), "the call was dropped mid-flight");
    wait_for_state(&client, &request.id, RecordState::Released).await;
    let lease = proceed(&client, &request).await;
    assert!(lease.fencing_token() > held.load(Ordering::SeqCst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_during_the_logic_surfaces_as_lease_lost() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("takeover").with_lease(Duration::from_secs(1));

    let slow = tokio::spawn({
        let client = client.clone();
        let request = request.clone();
        async move {
            client
                .run(&request, &Options::default(), |_| async {
                    tokio::time::sleep(Duration::from_millis(3000)).await;
                    Ok::<_, String>(StoredResponse::new(201, "slow"))
                })
                .await
        }
    });
    wait_for_state(&client, &request.id, RecordState::InProgress).await;
    tokio::time::sleep(Duration::from_millis(1300)).await; // The 1 s lease passes.
    let mut usurper = proceed(&client, &request).await;
    usurper
        .complete(&StoredResponse::new(201, "fast"))
        .await
        .unwrap();

    let result = slow.await.unwrap();

    assert!(
        matches!(result, Err(RunError::LeaseLost { ref response }) if response.body == b"slow"),
        "{result:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_returns_at_once_or_waits_for_the_outcome_when_asked() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("waiting");
    let first = tokio::spawn({
        let client = client.clone();
        let request = request.clone();
        async move {
            client
                .run(&request, &Options::default(), |_| async {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    Ok::<_, String>(StoredResponse::new(201, "first"))
                })
                .await
        }
    });
    wait_for_state(&client, &request.id, RecordState::InProgress).await;
    let ran_again = Arc::new(AtomicU32::new(0));

    let at_once = client
        .run(&request, &Options::default(), |_| async {
            Ok(StoredResponse::default())
        })
        .await;
    let waited = client
        .run(
            &request,
            &Options::default().wait_in_progress(Duration::from_secs(10)),
            |_| {
                let ran_again = ran_again.clone();
                async move {
                    ran_again.fetch_add(1, Ordering::SeqCst);
                    Ok(StoredResponse::default())
                }
            },
        )
        .await;

    assert!(
        matches!(at_once, Err(RunError::InProgress { retry_after }) if retry_after <= Duration::from_secs(1)),
        "{at_once:?}"
    );
    assert_eq!(
        waited.unwrap(),
        Ran::Replayed(StoredResponse::new(201, "first"))
    );
    assert_eq!(ran_again.load(Ordering::SeqCst), 0);
    assert!(matches!(first.await.unwrap(), Ok(Ran::Executed(_))));
}

#[tokio::test]
async fn an_unreachable_service_fails_closed_by_default_and_open_when_chosen() {
    let client = client_of_nothing().await;
    let request = request("down");
    let runs = AtomicU32::new(0);

    let closed = client
        .run(&request, &Options::default(), |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(StoredResponse::new(200, "liked"))
        })
        .await;
    let open = client
        .run(
            &request,
            &Options::default().on_unavailable(OnUnavailable::FailOpen),
            |attempt| {
                assert_eq!(attempt.fencing_token, None);
                let runs = &runs;
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok(StoredResponse::new(200, "liked"))
                }
            },
        )
        .await;

    assert!(
        matches!(closed, Err(RunError::Service(ref e)) if e.is_unavailable()),
        "{closed:?}"
    );
    assert_eq!(
        open.unwrap(),
        Ran::Unprotected(StoredResponse::new(200, "liked"))
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "only the fail-open call ran"
    );
}

#[tokio::test]
async fn a_fingerprint_mismatch_is_its_own_error() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("mismatch");
    client
        .run(&request, &Options::default(), |_| async {
            Ok(StoredResponse::new(201, "a"))
        })
        .await
        .unwrap();
    let other = idempotency_client::AcquireRequest {
        fingerprint: b"another body".to_vec(),
        ..request
    };

    let result = client
        .run(&other, &Options::default(), |_| async {
            Ok(StoredResponse::new(201, "b"))
        })
        .await;

    assert!(
        matches!(result, Err(RunError::FingerprintMismatch)),
        "{result:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_renews_before_a_lease_shorter_than_its_interval_passes() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let mut request = request("keep-alive-short-lease");
    // Held for 1 s, renewed to 10 s every 2 s: the first renewal must not
    // wait the 2 s, or the key is free to take over after 1 s.
    request.lease = Some(Duration::from_secs(1));
    let options = Options::default().keep_alive(Duration::from_secs(2), Duration::from_secs(10));
    let runs = Arc::new(AtomicU32::new(0));
    let first = tokio::spawn({
        let (client, request, options, runs) = (
            client.clone(),
            request.clone(),
            options.clone(),
            runs.clone(),
        );
        async move {
            client
                .run(&request, &options, |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                    Ok::<_, String>(StoredResponse::new(201, "first"))
                })
                .await
        }
    });

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = client
        .run(&request, &options, |_| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, String>(StoredResponse::new(201, "second")) }
        })
        .await;

    assert!(second.is_err(), "{second:?}");
    let first = first.await.unwrap();
    assert!(matches!(first, Ok(Ran::Executed(_))), "{first:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_response_the_service_refuses_is_failed_in_its_place_so_a_retry_never_runs_again() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let mut request = request("refused-response");
    request.lease = Some(Duration::from_secs(1));
    let runs = AtomicU32::new(0);
    // Over the service's 1 MiB limit on stored responses.
    let work = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, String>(StoredResponse::new(201, vec![b'x'; 1024 * 1024 + 1]))
    };

    let first = client.run(&request, &Options::default(), |_| work()).await;
    assert!(
        matches!(
            first,
            Err(RunError::NotStored {
                error: idempotency_client::Error::InvalidArgument { .. },
                ..
            })
        ),
        "{first:?}"
    );
    // Past the lease, a retry would take the key over and run again.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let retry = client.run(&request, &Options::default(), |_| work()).await;

    match retry {
        Err(RunError::PreviouslyFailed(failure)) => {
            assert_eq!(failure.status_code, 500);
            assert_eq!(
                failure.body,
                idempotency_client::UNSTORABLE_RESPONSE.as_bytes()
            );
        }
        other => panic!("expected the stored failure, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
