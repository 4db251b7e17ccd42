//! BatchStream with auth on: a stream needs a credential to open, each
//! message is authenticated again and each item checked against its
//! namespace, and a credential revoked mid-stream ends the stream.

use std::time::Duration;

use idempotency_client::pb::{self, batch_acquire_result, batch_stream_request::Batch};
use idempotency_tests::{
    security::{static_tokens, tls_channel},
    stream::{OpenStream, acquired as acquire_results, message, message_error},
};
use tonic::Code;

use crate::support::*;

impl Secured {
    async fn stream(
        &self,
        token: Option<&str>,
        cert: Option<&str>,
    ) -> Result<OpenStream, tonic::Status> {
        let cert = cert.map(|uri| self.cert(uri));
        let channel = tls_channel(self.server.addr, &self.ca(), cert.as_ref())
            .await
            .expect("connecting over TLS");
        OpenStream::open(channel, token).await
    }
}

fn acquire_batch(ids: &[pb::RecordId]) -> Batch {
    Batch::Acquire(pb::BatchAcquireRequest {
        requests: ids.iter().map(acquire_request).collect(),
    })
}

#[tokio::test]
async fn a_stream_needs_a_credential_and_each_item_its_namespace() {
    let secured = Secured::start().await;
    let refused_open = secured.stream(None, None).await.map(drop);
    refused(refused_open, Code::Unauthenticated, "UNAUTHENTICATED");
    let refused_open = secured
        .stream(Some("no-such-token-123"), None)
        .await
        .map(drop);
    refused(refused_open, Code::Unauthenticated, "UNAUTHENTICATED");

    // A client certificate is the stream's credential as it is a call's.
    for (token, cert) in [(Some(IMPORTER_TOKEN), None), (None, Some(PAYMENTS_SPIFFE))] {
        let mut stream = secured.stream(token, cert).await.expect("the stream opens");
        let mine = id(
            "payments",
            &format!("stream-mine-{}", cert.is_some() as u8).repeat(2),
        );
        let theirs = id(
            "refunds",
            &format!("stream-theirs-{}", cert.is_some() as u8).repeat(2),
        );
        stream.send(message(1, acquire_batch(&[mine.clone(), theirs.clone()])));
        let results = acquire_results(stream.answer().await);
        assert!(
            matches!(
                results[0].result,
                Some(batch_acquire_result::Result::Response(_))
            ),
            "{results:?}"
        );
        match &results[1].result {
            Some(batch_acquire_result::Result::Error(status)) => assert_eq!(
                item_reason(status),
                (
                    Code::PermissionDenied as i32,
                    "NAMESPACE_FORBIDDEN".to_owned()
                )
            ),
            other => panic!("expected the other namespace refused, got {other:?}"),
        }
        let written: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE key = $1")
                .bind(&theirs.key)
                .fetch_one(&secured.db.pool)
                .await
                .unwrap();
        assert_eq!(written, 0);
    }
}

#[tokio::test]
async fn a_revoked_token_ends_the_stream_at_its_next_message() {
    let secured = Secured::start().await;
    let token = "streaming-token-5e6f7a8b";
    let with_token = format!(
        "{}{}",
        default_tokens(),
        static_tokens(&[("payments-importer", token)])
    );
    secured.files.dir.write("tokens.toml", &with_token);
    let mut stream = None;
    for _ in 0..100 {
        if let Ok(opened) = secured.stream(Some(token), None).await {
            stream = Some(opened);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut stream = stream.expect("the added token opens a stream");
    stream.send(message(
        1,
        acquire_batch(&[id("payments", "stream-before-revoke")]),
    ));
    acquire_results(stream.answer().await);

    secured.files.dir.write("tokens.toml", default_tokens());
    // Sent until one is refused (the files are re-read every 100 ms).
    let late = id("payments", "stream-after-revoke");
    let mut refused_answer = None;
    for n in 2..100 {
        if !stream.try_send(message(n, acquire_batch(std::slice::from_ref(&late)))) {
            break;
        }
        let answer = stream.answer().await;
        if matches!(
            answer.result,
            Some(pb::batch_stream_response::Result::Error(_))
        ) {
            refused_answer = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = refused_answer.expect("a message refused once the token was revoked");
    refused(
        Err::<(), _>(message_error(answer)),
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    let (rest, end) = stream.end().await;
    assert!(rest.is_empty(), "{rest:?}");
    refused(end, Code::Unauthenticated, "UNAUTHENTICATED");
}

#[tokio::test]
async fn a_principal_opens_at_most_its_streams_across_connections() {
    let secured =
        Secured::start_with(|settings| settings.streams.stream_max_per_principal = 1).await;
    let _first = secured.stream(Some(IMPORTER_TOKEN), None).await.unwrap();
    let second = secured.stream(Some(IMPORTER_TOKEN), None).await.map(drop);
    refused(second, Code::ResourceExhausted, "TOO_MANY_STREAMS");
    // Another principal is not held back.
    let _other = secured.stream(Some(SUPPORT_TOKEN), None).await.unwrap();
}
