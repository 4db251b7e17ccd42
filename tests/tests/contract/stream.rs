//! BatchStream: each message is served as its unary batch call, answered by
//! id as it is ready; a message's failure answers that message alone; the
//! stream ends for its own reasons only, after answering what it read.

use std::time::Duration;

use idempotency_client::pb::{
    self, acquire_response::Outcome, batch_acquire_result, batch_complete_result,
    batch_stream_request::Batch,
};
use idempotency_tests::{
    TestApp, TestServer, http_get, metric_value, record_id, response, spawn_app_with,
    stream::{OpenStream, RawStream, acquired, completed, framed, message, message_error},
    unique_key,
};
use tonic::Code;
use tonic_types::StatusExt;

use crate::batch::{acquire_item, complete_item};
use crate::support::*;

async fn open(server: &TestServer) -> OpenStream {
    OpenStream::open(TestServer::channel_to(server.addr).await, None)
        .await
        .expect("the stream opens")
}

fn outcome(result: &pb::BatchAcquireResult) -> &Outcome {
    match &result.result {
        Some(batch_acquire_result::Result::Response(response)) => {
            response.outcome.as_ref().expect("an outcome")
        }
        other => panic!("expected an outcome, got {other:?}"),
    }
}

async fn state(app: &TestApp, key: &str) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM idempotency_records WHERE key = $1")
        .bind(key)
        .fetch_optional(&app.db.pool)
        .await
        .unwrap()
}

async fn metrics(server: &TestServer) -> String {
    http_get(server.metrics_addr, "/metrics").await
}

#[tokio::test]
async fn messages_are_answered_as_their_unary_batch_calls_and_the_stream_goes_on() {
    let app = spawn_app_with(|_| {}).await;
    let mut stream = open(&app.server).await;
    let first = record_id(&unique_key("stream-a"));
    let second = record_id(&unique_key("stream-b"));
    let mut bad = record_id(&unique_key("stream-bad"));
    bad.key = "short".into();

    stream.acquire(
        1,
        vec![
            acquire_item(&first, b"fp"),
            acquire_item(&second, b"fp"),
            acquire_item(&bad, b"fp"),
        ],
    );
    let answer = stream.answer().await;
    assert_eq!(answer.id, 1);
    let results = acquired(answer);
    assert_eq!(results.len(), 3);
    let tokens = [token(outcome(&results[0])), token(outcome(&results[1]))];
    // A bad item fails alone, as in the unary batch.
    match &results[2].result {
        Some(batch_acquire_result::Result::Error(status)) => {
            assert_eq!(status.code, Code::InvalidArgument as i32);
        }
        other => panic!("expected the bad item's error, got {other:?}"),
    }

    // A message without a batch is answered alone, with the field named.
    stream.send(pb::BatchStreamRequest {
        id: 2,
        ..Default::default()
    });
    let answer = stream.answer().await;
    assert_eq!(answer.id, 2);
    let status = message_error(answer);
    assert_eq!(status.code(), Code::InvalidArgument);
    let violations = status.get_details_bad_request().unwrap().field_violations;
    assert_eq!(violations[0].field, "batch");

    // The stream went on: Completes, then a replay, on the same stream.
    stream.complete(
        u64::MAX,
        vec![
            complete_item(&first, tokens[0]),
            complete_item(&second, tokens[1]),
        ],
    );
    let answer = stream.answer().await;
    assert_eq!(answer.id, u64::MAX);
    for result in completed(answer) {
        assert!(
            matches!(
                result.result,
                Some(batch_complete_result::Result::Response(_))
            ),
            "{result:?}"
        );
    }
    stream.acquire(3, vec![acquire_item(&first, b"fp")]);
    let replayed = acquired(stream.answer().await);
    assert!(
        matches!(outcome(&replayed[0]), Outcome::Completed(_)),
        "{replayed:?}"
    );
    assert_eq!(state(&app, &first.key).await.as_deref(), Some("completed"));
    assert_eq!(state(&app, &second.key).await.as_deref(), Some("completed"));

    // Each item counted as its unary RPC; the stream's own series.
    let page = metrics(&app.server).await;
    let acquires = metric_value(
        &page,
        "idempotency_requests_total{rpc=\"Acquire\",outcome=\"acquired\",namespace=\"payments\"}",
    );
    assert_eq!(acquires, Some(2.0), "{page}");
    assert_eq!(
        metric_value(&page, "idempotency_grpc_streams_open"),
        Some(1.0)
    );

    stream.close();
    let (rest, end) = stream.end().await;
    assert!(rest.is_empty());
    end.expect("closing our side ends the stream OK");
    let page = metrics(&app.server).await;
    assert_eq!(
        metric_value(&page, "idempotency_grpc_streams_open"),
        Some(0.0)
    );
    assert_eq!(
        metric_value(
            &page,
            "idempotency_grpc_streams_ended_total{reason=\"closed\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric_value(&page, "idempotency_grpc_stream_messages_in_flight"),
        Some(0.0)
    );
}

#[tokio::test]
async fn answers_come_as_they_are_ready_and_a_late_message_fails_alone_at_its_deadline() {
    let app = spawn_app_with(|_| {}).await;
    let mut client = app.client.clone();
    let held = record_id(&unique_key("stream-held"));
    let held_token = token(&acquire(&mut client, &held, b"fp").await);
    let blocker = idempotency_tests::lock_record(&app.db, &held.key).await;
    let mut stream = open(&app.server).await;

    // Message 1 waits on the row lock, with a deadline of its own.
    stream.send(pb::BatchStreamRequest {
        timeout: Some(prost_types::Duration {
            seconds: 0,
            nanos: 500_000_000,
        }),
        ..message(
            1,
            Batch::Complete(pb::BatchCompleteRequest {
                requests: vec![complete_item(&held, held_token)],
            }),
        )
    });
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    // Message 2 overtakes it.
    let free = record_id(&unique_key("stream-free"));
    stream.acquire(2, vec![acquire_item(&free, b"fp")]);
    let answer = stream.answer().await;
    assert_eq!(answer.id, 2);
    token(outcome(&acquired(answer)[0]));
    // Message 1 fails at its own deadline, as the unary call would.
    let answer = stream.answer().await;
    assert_eq!(answer.id, 1);
    assert_error(
        Err::<(), _>(message_error(answer)),
        Code::DeadlineExceeded,
        "REQUEST_TIMEOUT",
    );
    blocker.rollback().await.unwrap();
    // And the stream goes on.
    stream.acquire(3, vec![acquire_item(&free, b"fp")]);
    let answer = stream.answer().await;
    assert_eq!(answer.id, 3);
    stream.close();
    assert!(stream.end().await.1.is_ok());
}

#[tokio::test]
async fn a_stream_reads_no_more_than_its_messages_in_flight() {
    let app = spawn_app_with(|settings| settings.streams.stream_max_in_flight = 2).await;
    let mut client = app.client.clone();
    let held: Vec<_> = (0..2)
        .map(|_| record_id(&unique_key("stream-held")))
        .collect();
    let mut tokens = Vec::new();
    for id in &held {
        tokens.push(token(&acquire(&mut client, id, b"fp").await));
    }
    let mut blockers = Vec::new();
    for id in &held {
        blockers.push(idempotency_tests::lock_record(&app.db, &id.key).await);
    }
    let mut stream = open(&app.server).await;
    for (n, (id, token)) in held.iter().zip(&tokens).enumerate() {
        stream.complete(n as u64, vec![complete_item(id, *token)]);
    }
    let third = record_id(&unique_key("stream-third"));
    stream.acquire(2, vec![acquire_item(&third, b"fp")]);
    // Both slots are taken by the held messages: the third is not read, so
    // not run.
    assert!(
        stream
            .answer_within(Duration::from_millis(700))
            .await
            .is_none()
    );
    assert_eq!(state(&app, &third.key).await, None);
    for blocker in blockers {
        blocker.rollback().await.unwrap();
    }
    let mut ids: Vec<u64> = Vec::new();
    for _ in 0..3 {
        ids.push(stream.answer().await.id);
    }
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2]);
    assert_eq!(
        state(&app, &third.key).await.as_deref(),
        Some("in_progress")
    );
}

#[tokio::test]
async fn each_message_is_a_call_to_the_servers_call_limit() {
    let app = spawn_app_with(|settings| settings.connections.max_concurrent_calls = 1).await;
    let mut client = app.client.clone();
    let held = record_id(&unique_key("stream-held"));
    let held_token = token(&acquire(&mut client, &held, b"fp").await);
    let blocker = idempotency_tests::lock_record(&app.db, &held.key).await;
    let mut stream = open(&app.server).await;
    stream.complete(1, vec![complete_item(&held, held_token)]);
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    let refused = record_id(&unique_key("stream-refused"));
    stream.acquire(2, vec![acquire_item(&refused, b"fp")]);
    let answer = stream.answer().await;
    assert_eq!(answer.id, 2);
    assert_error(
        Err::<(), _>(message_error(answer)),
        Code::Unavailable,
        "OVERLOADED",
    );
    assert_eq!(state(&app, &refused.key).await, None);
    blocker.rollback().await.unwrap();
    assert_eq!(stream.answer().await.id, 1);
}

#[tokio::test]
async fn a_connection_opens_at_most_its_streams_and_the_server_its_own() {
    let app = spawn_app_with(|settings| {
        settings.streams.stream_max_per_connection = 2;
        settings.streams.max_streams = 3;
    })
    .await;
    let channel = TestServer::channel_to(app.server.addr).await;
    let first = OpenStream::open(channel.clone(), None).await.unwrap();
    let _second = OpenStream::open(channel.clone(), None).await.unwrap();
    let refused = OpenStream::open(channel.clone(), None).await.map(drop);
    assert_error(refused, Code::ResourceExhausted, "TOO_MANY_STREAMS");
    // Another connection may; then the server is full.
    let _third = open(&app.server).await;
    let refused = open_result(&app.server).await;
    assert_error(refused, Code::Unavailable, "OVERLOADED");
    // An ended stream gives its place back.
    drop(first);
    let mut reopened = None;
    for _ in 0..50 {
        if let Ok(stream) = OpenStream::open(channel.clone(), None).await {
            reopened = Some(stream);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reopened.is_some(), "the place was never given back");
    let page = metrics(&app.server).await;
    assert_eq!(
        metric_value(
            &page,
            "idempotency_grpc_streams_refused_total{reason=\"too_many_streams\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric_value(
            &page,
            "idempotency_grpc_streams_ended_total{reason=\"cancelled\"}"
        ),
        Some(1.0)
    );
}

async fn open_result(server: &TestServer) -> Result<(), tonic::Status> {
    OpenStream::open(TestServer::channel_to(server.addr).await, None)
        .await
        .map(drop)
}

#[tokio::test]
async fn an_idle_stream_ends_ok() {
    let app = spawn_app_with(|settings| {
        settings.streams.stream_idle_timeout = Duration::from_millis(400);
    })
    .await;
    let mut stream = open(&app.server).await;
    stream.acquire(
        1,
        vec![acquire_item(&record_id(&unique_key("idle")), b"fp")],
    );
    assert_eq!(stream.answer().await.id, 1);
    let (rest, end) = stream.end().await;
    assert!(rest.is_empty());
    end.expect("an idle stream ends OK");
    let page = metrics(&app.server).await;
    assert_eq!(
        metric_value(
            &page,
            "idempotency_grpc_streams_ended_total{reason=\"idle\"}"
        ),
        Some(1.0)
    );
}

/// Messages sent until the stream ends: every one answered ran, and every
/// one not answered did not.
#[tokio::test]
async fn at_its_age_a_stream_answers_what_it_read_and_ends_ok_and_what_it_did_not_read_never_ran() {
    let app = spawn_app_with(|settings| {
        settings.streams.stream_max_age = Duration::from_millis(800);
    })
    .await;
    let stream = open(&app.server).await;
    let ids: Vec<_> = (0..300).map(|_| record_id(&unique_key("aged"))).collect();
    let keys: Vec<String> = ids.iter().map(|id| id.key.clone()).collect();
    let sender = tokio::spawn(async move {
        for (n, id) in ids.iter().enumerate() {
            let sent = stream.try_send(message(
                n as u64,
                Batch::Acquire(pb::BatchAcquireRequest {
                    requests: vec![acquire_item(id, b"fp")],
                }),
            ));
            if !sent {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stream.end().await
    });
    let (answers, end) = sender.await.unwrap();
    end.expect("a stream at its age ends OK");
    assert!(
        !answers.is_empty() && answers.len() < keys.len(),
        "{}",
        answers.len()
    );
    let answered: std::collections::HashSet<u64> = answers.iter().map(|answer| answer.id).collect();
    for (n, key) in keys.iter().enumerate() {
        let ran = state(&app, key).await.is_some();
        assert_eq!(ran, answered.contains(&(n as u64)), "message {n}");
    }
    let page = metrics(&app.server).await;
    assert_eq!(
        metric_value(
            &page,
            "idempotency_grpc_streams_ended_total{reason=\"max_age\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_message_too_large_ends_the_stream_after_answering_the_rest() {
    let app = spawn_app_with(|_| {}).await;
    let mut client = app.client.clone();
    let held = record_id(&unique_key("stream-held"));
    let held_token = token(&acquire(&mut client, &held, b"fp").await);
    let blocker = idempotency_tests::lock_record(&app.db, &held.key).await;
    let stream = open(&app.server).await;
    stream.complete(1, vec![complete_item(&held, held_token)]);
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    // Past the largest batch plus the envelope: refused before it is read.
    let big = record_id(&unique_key("stream-big"));
    stream.complete(
        2,
        vec![pb::CompleteRequest {
            id: Some(big),
            fencing_token: 1,
            response: Some(response(200, &"x".repeat(5 * 1024 * 1024))),
        }],
    );
    // The message read before it is answered first.
    blocker.rollback().await.unwrap();
    let (answers, end) = stream.end().await;
    assert_eq!(
        answers.iter().map(|answer| answer.id).collect::<Vec<_>>(),
        [1]
    );
    assert_error(end, Code::OutOfRange, "MESSAGE_TOO_LARGE");
}

#[tokio::test]
async fn on_shutdown_a_stream_stops_reading_answers_what_it_read_and_ends_ok() {
    let mut app = spawn_app_with(|_| {}).await;
    let mut client = app.client.clone();
    let held = record_id(&unique_key("stream-held"));
    let held_token = token(&acquire(&mut client, &held, b"fp").await);
    let blocker = idempotency_tests::lock_record(&app.db, &held.key).await;
    let stream = open(&app.server).await;
    stream.complete(1, vec![complete_item(&held, held_token)]);
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    app.server.signal_shutdown();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Sent after the drain began: not read, so never run.
    let late = record_id(&unique_key("stream-late"));
    stream.acquire(2, vec![acquire_item(&late, b"fp")]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    blocker.rollback().await.unwrap();
    let (answers, end) = stream.end().await;
    assert_eq!(
        answers.iter().map(|answer| answer.id).collect::<Vec<_>>(),
        [1]
    );
    end.expect("a drained stream ends OK");
    assert_eq!(state(&app, &held.key).await.as_deref(), Some("completed"));
    assert_eq!(state(&app, &late.key).await, None);
}

#[tokio::test]
async fn on_shutdown_a_message_unanswered_in_the_grace_ends_the_stream_unavailable() {
    let mut app = spawn_app_with(|settings| {
        settings.drain_timeout = Duration::from_secs(2);
    })
    .await;
    let mut client = app.client.clone();
    let held = record_id(&unique_key("stream-held"));
    let held_token = token(&acquire(&mut client, &held, b"fp").await);
    let blocker = idempotency_tests::lock_record(&app.db, &held.key).await;
    let stream = open(&app.server).await;
    stream.complete(1, vec![complete_item(&held, held_token)]);
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    app.server.signal_shutdown();
    let (answers, end) = stream.end().await;
    assert!(answers.is_empty(), "{answers:?}");
    assert_error(end, Code::Unavailable, "DRAINING");
    blocker.rollback().await.unwrap();
}

#[tokio::test]
async fn each_message_is_traced_and_logged_as_its_unary_call_in_the_callers_trace() {
    let sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let ((), events) = idempotency_tests::capture_logs(async {
        let app = spawn_app_with(|settings| settings.log_calls = true).await;
        let mut stream = open(&app.server).await;
        let key = record_id(&unique_key("traced"));
        stream.send(pb::BatchStreamRequest {
            traceparent: sent.into(),
            ..message(
                1,
                Batch::Acquire(pb::BatchAcquireRequest {
                    requests: vec![acquire_item(&key, b"fp")],
                }),
            )
        });
        stream.answer().await;
        // Malformed: a trace of its own, and the message is served.
        stream.send(pb::BatchStreamRequest {
            traceparent: "00-not-a-trace".into(),
            ..message(
                2,
                Batch::Acquire(pb::BatchAcquireRequest {
                    requests: vec![acquire_item(&key, b"fp")],
                }),
            )
        });
        stream.answer().await;
    })
    .await;
    let lines: Vec<_> = events
        .iter()
        .filter(|event| {
            event["target"] == "idempotency_server::calls" && event["rpc"] == "BatchAcquire"
        })
        .collect();
    assert_eq!(lines.len(), 2, "{events:#?}");
    assert_eq!(
        lines[0]["span"]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736",
        "{:#?}",
        lines[0]
    );
    let own = lines[1]["span"]["trace_id"].as_str().unwrap();
    assert_eq!(own.len(), 32);
    assert_ne!(own, "4bf92f3577b34da6a3ce929d0e0e4736");
}

#[tokio::test]
async fn a_message_that_is_not_protobuf_ends_the_stream_invalid_argument() {
    let app = spawn_app_with(|_| {}).await;
    let channel = TestServer::channel_to(app.server.addr).await;
    let key = record_id(&unique_key("raw"));
    let valid = prost::Message::encode_to_vec(&message(
        1,
        Batch::Acquire(pb::BatchAcquireRequest {
            requests: vec![acquire_item(&key, b"fp")],
        }),
    ));
    // A field of wire type 7, which protobuf does not have.
    let broken = vec![0x0f, 0x01];
    let (answers, end) =
        idempotency_tests::stream::raw_exchange(channel, vec![valid, broken]).await;
    assert_eq!(answers.len(), 1, "the valid message is answered first");
    assert_error(end, Code::InvalidArgument, "INVALID_ARGUMENT");
}

#[tokio::test]
async fn a_messages_batch_is_admitted_and_decoded_as_its_unary_calls_and_fails_alone() {
    let app = spawn_app_with(|_| {}).await;
    let max = idempotency_server::domain::Limits::default().max_batch_items;
    let ids: Vec<_> = (0..=max)
        .map(|_| record_id(&unique_key("stream-oversized")))
        .collect();
    let oversized = |id| {
        message(
            id,
            Batch::Acquire(pb::BatchAcquireRequest {
                requests: ids.iter().map(|id| acquire_item(id, b"fp")).collect(),
            }),
        )
    };
    let empty = message(2, Batch::Complete(pb::BatchCompleteRequest::default()));
    // Envelopes around batches that are not protobuf: a varint cut off, and
    // an item of one (the batch's own fields are whole).
    let undecodable = vec![0x08, 3, 0x22, 2, 0xff, 0xff];
    let undecodable_item = vec![0x08, 4, 0x22, 4, 0x0a, 2, 0xff, 0xff];
    let valid = message(
        5,
        Batch::Acquire(pb::BatchAcquireRequest {
            requests: vec![acquire_item(&ids[0], b"fp")],
        }),
    );
    let channel = TestServer::channel_to(app.server.addr).await;
    let (answers, end) = idempotency_tests::stream::raw_exchange(
        channel,
        vec![
            prost::Message::encode_to_vec(&oversized(1)),
            prost::Message::encode_to_vec(&empty),
            undecodable,
            undecodable_item,
            prost::Message::encode_to_vec(&valid),
        ],
    )
    .await;
    end.expect("failed messages fail alone");
    let mut answers = answers;
    answers.sort_by_key(|answer| answer.id);
    let ids_answered: Vec<u64> = answers.iter().map(|answer| answer.id).collect();
    assert_eq!(ids_answered, [1, 2, 3, 4, 5]);
    let mut answers = answers.into_iter();
    // Counted on the wire before decoding, as admission refuses the unary call.
    let status = message_error(answers.next().unwrap());
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains(&max.to_string()), "{status:?}");
    // Refused as the unary call is (admission counts no item), naming the field.
    let status = message_error(answers.next().unwrap());
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.get_details_bad_request().unwrap().field_violations[0].field,
        "requests"
    );
    // Not protobuf: refused by admission's count, as the unary call is;
    // an item that is not: INTERNAL, as gRPC's codec answers a unary call.
    let status = message_error(answers.next().unwrap());
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("not a valid protobuf"),
        "{status:?}"
    );
    assert_eq!(
        message_error(answers.next().unwrap()).code(),
        Code::Internal
    );
    let results = acquired(answers.next().unwrap());
    assert!(matches!(outcome(&results[0]), Outcome::Acquired(_)));
    assert_eq!(app.db.row_count().await, 1, "only the valid message wrote");
}

/// A raw stream on which one valid Acquire of a new key was sent.
async fn raw_stream_with_one_acquire(app: &TestApp, label: &str) -> RawStream {
    let key = record_id(&unique_key(label));
    let channel = TestServer::channel_to(app.server.addr).await;
    let stream = RawStream::open(channel, &[]).await;
    stream.send(&framed(&message(
        1,
        Batch::Acquire(pb::BatchAcquireRequest {
            requests: vec![acquire_item(&key, b"fp")],
        }),
    )));
    stream
}

#[tokio::test]
async fn a_compressed_message_ends_the_stream_invalid_argument_after_answering_the_rest() {
    let app = spawn_app_with(|_| {}).await;
    let stream = raw_stream_with_one_acquire(&app, "raw-compressed").await;
    // The compressed flag set, on an id field.
    stream.send(&[1, 0, 0, 0, 2, 0x08, 0x02]);
    let (answers, end) = stream.end().await;
    assert_eq!(answers.len(), 1, "the message before it is answered");
    let status = assert_error(end, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert!(status.message().contains("compressed"), "{status:?}");
}

#[tokio::test]
async fn a_stream_opened_with_a_grpc_encoding_is_refused_invalid_argument() {
    let app = spawn_app_with(|_| {}).await;
    let channel = TestServer::channel_to(app.server.addr).await;
    let stream = RawStream::open(channel, &[("grpc-encoding", "gzip")]).await;
    let (answers, end) = stream.end().await;
    assert!(answers.is_empty());
    let status = assert_error(end, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert!(status.message().contains("grpc-encoding"), "{status:?}");
    let page = metrics(&app.server).await;
    assert_eq!(
        metric_value(
            &page,
            "idempotency_grpc_streams_refused_total{reason=\"bad_message\"}"
        ),
        Some(1.0),
        "{page}"
    );
}

#[tokio::test]
async fn a_message_cut_off_ends_the_stream_by_the_request_timeout_and_frees_its_charge() {
    let app = spawn_app_with(|settings| settings.request_timeout = Duration::from_secs(3)).await;
    let stream = raw_stream_with_one_acquire(&app, "raw-cut").await;
    // A prefix announcing 100,000 bytes, then ten of them, and the caller's
    // side left open: the stream ends by the request timeout (within the
    // test's patience), not by the idle timeout's five minutes.
    let mut cut = vec![0];
    cut.extend_from_slice(&100_000u32.to_be_bytes());
    cut.extend_from_slice(&[0x08; 10]);
    stream.send(&cut);
    let page = wait_for_metric(&app.server, "idempotency_in_flight_bytes", 100_000.0).await;
    assert!(
        page.contains("idempotency_in_flight_bytes 100000"),
        "charged from its prefix"
    );
    let (answers, end) = stream.end().await;
    assert_eq!(answers.len(), 1, "the message before it is answered");
    let status = assert_error(end, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert!(status.message().contains("not sent in full"), "{status:?}");
    wait_for_metric(&app.server, "idempotency_in_flight_bytes", 0.0).await;
}

/// Polls /metrics until `series` reads `value`.
async fn wait_for_metric(server: &TestServer, series: &str, value: f64) -> String {
    for _ in 0..100 {
        let page = metrics(server).await;
        if metric_value(&page, series) == Some(value) {
            return page;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{series} never read {value}");
}

#[tokio::test]
async fn a_caller_that_leaves_answers_unread_loses_the_stream_and_what_they_held() {
    leaves_answers_unread(false).await;
}

/// Its side closed, the session has ended; its answers are still bounded.
#[tokio::test]
async fn a_caller_that_closes_and_never_reads_loses_what_its_answers_held() {
    leaves_answers_unread(true).await;
}

async fn leaves_answers_unread(close: bool) {
    let app = spawn_app_with(|settings| {
        settings.request_timeout = Duration::from_secs(1);
        settings.streams.stream_max_in_flight = 2;
    })
    .await;
    let mut client = app.client.clone();
    // Replays of large stored responses: answers of nearly 1 MiB each, more
    // than the caller's HTTP/2 window takes.
    let body = "r".repeat(1_000_000);
    let ids: Vec<_> = (0..8).map(|_| record_id(&unique_key("unread"))).collect();
    for id in &ids {
        let t = token(&acquire(&mut client, id, b"fp").await);
        complete(&mut client, id, t, response(200, &body))
            .await
            .unwrap();
    }
    let mut stream = open(&app.server).await;
    for (n, id) in ids.iter().enumerate() {
        stream.acquire(n as u64, vec![acquire_item(id, b"fp")]);
    }
    if close {
        stream.close();
    }
    // Nothing is read here: the server ends the stream after the answers
    // waited a second unread, and lets go of them.
    wait_for_metric(
        &app.server,
        "idempotency_grpc_streams_ended_total{reason=\"slow_reader\"}",
        1.0,
    )
    .await;
    let page = wait_for_metric(
        &app.server,
        "idempotency_grpc_stream_messages_in_flight",
        0.0,
    )
    .await;
    assert_eq!(
        metric_value(&page, "idempotency_in_flight_bytes"),
        Some(0.0),
        "{page}"
    );
    let (answers, end) = stream.end().await;
    assert!(answers.len() < ids.len(), "{}", answers.len());
    assert_error(end, Code::ResourceExhausted, "SLOW_READER");
}

#[tokio::test]
async fn a_message_past_the_memory_budget_is_not_read_and_ends_the_stream_unavailable() {
    // The least budget allowed: twice the largest message and a call's cost.
    let app = spawn_app_with(|settings| settings.max_in_flight_bytes = 8_400_000).await;
    let mut client = app.client.clone();
    let ids: Vec<_> = (0..5).map(|_| record_id(&unique_key("budget"))).collect();
    let mut tokens = Vec::new();
    for id in &ids {
        tokens.push(token(&acquire(&mut client, id, b"fp").await));
    }
    let mut blockers = Vec::new();
    for id in &ids[..4] {
        blockers.push(idempotency_tests::lock_record(&app.db, &id.key).await);
    }
    let body = "b".repeat(1_000_000);
    let mut stream = open(&app.server).await;
    // Four Completes of 1 MB wait on their rows, holding about 2 MB each.
    for (n, (id, t)) in ids.iter().zip(&tokens).take(4).enumerate() {
        stream.send(message(
            n as u64,
            Batch::Complete(pb::BatchCompleteRequest {
                requests: vec![pb::CompleteRequest {
                    response: Some(response(200, &body)),
                    ..complete_item(id, *t)
                }],
            }),
        ));
    }
    for _ in 0..100 {
        if idempotency_tests::lock_waiters(&app.db).await >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The fifth does not fit beside them: it is not read, so never runs.
    stream.send(message(
        4,
        Batch::Complete(pb::BatchCompleteRequest {
            requests: vec![pb::CompleteRequest {
                response: Some(response(200, &body)),
                ..complete_item(&ids[4], tokens[4])
            }],
        }),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    for blocker in blockers {
        blocker.rollback().await.unwrap();
    }
    stream.close();
    let (answers, end) = stream.end().await;
    let mut answered: Vec<u64> = answers.iter().map(|answer| answer.id).collect();
    answered.sort_unstable();
    assert_eq!(answered, [0, 1, 2, 3]);
    assert_error(end, Code::Unavailable, "OVERLOADED");
    assert_eq!(
        state(&app, &ids[4].key).await.as_deref(),
        Some("in_progress")
    );
    assert_eq!(state(&app, &ids[0].key).await.as_deref(), Some("completed"));
}
