//! A caller touches only the namespaces its grants name: every RPC and
//! every batch item, the same answer whether the record exists or not, and
//! nothing read or written.

use idempotency_client::pb::{self, acquire_response::Outcome};
use tonic::Code;

use crate::support::*;

#[tokio::test]
async fn a_caller_cannot_read_or_change_another_namespace_through_any_rpc() {
    let secured = Secured::start().await;
    let mut owner = secured.mtls(REFUNDS_SPIFFE).await;
    let mut stranger = secured.mtls(PAYMENTS_SPIFFE).await;

    // refunds' record, in progress, as its owner left it.
    let existing = id("refunds", "refund-key-0001");
    let missing = id("refunds", "refund-key-0002");
    let token = acquired(&mut owner, &existing).await;
    let before = get(&mut owner, &existing).await.unwrap();

    // Each refusal is compared between the existing and the missing record:
    // the answer must not tell them apart.
    let mut denials = Vec::new();
    for target in [&existing, &missing] {
        let mut answers = vec![
            refused(
                acquire(&mut stranger, target).await,
                Code::PermissionDenied,
                "NAMESPACE_FORBIDDEN",
            ),
            refused(
                get(&mut stranger, target).await,
                Code::PermissionDenied,
                "NAMESPACE_FORBIDDEN",
            ),
        ];
        let complete = stranger
            .complete(pb::CompleteRequest {
                id: Some(target.clone()),
                fencing_token: token,
                response: Some(response()),
            })
            .await;
        answers.push(refused(
            complete,
            Code::PermissionDenied,
            "NAMESPACE_FORBIDDEN",
        ));
        for retryable in [true, false] {
            let fail = stranger
                .fail(pb::FailRequest {
                    id: Some(target.clone()),
                    fencing_token: token,
                    retryable,
                    error_response: (!retryable).then(response),
                })
                .await;
            answers.push(refused(fail, Code::PermissionDenied, "NAMESPACE_FORBIDDEN"));
        }
        let renew = stranger
            .renew(pb::RenewRequest {
                id: Some(target.clone()),
                fencing_token: token,
                lease: Some(idempotency_tests::seconds(3600)),
            })
            .await;
        answers.push(refused(
            renew,
            Code::PermissionDenied,
            "NAMESPACE_FORBIDDEN",
        ));
        let batch = stranger
            .batch_acquire(pb::BatchAcquireRequest {
                requests: vec![acquire_request(target)],
            })
            .await
            .expect("the batch is answered")
            .into_inner();
        let Some(pb::batch_acquire_result::Result::Error(status)) = &batch.results[0].result else {
            panic!("batch item not refused: {batch:?}");
        };
        assert_eq!(
            item_reason(status),
            (Code::PermissionDenied as i32, "NAMESPACE_FORBIDDEN".into())
        );
        let batch = stranger
            .batch_complete(pb::BatchCompleteRequest {
                requests: vec![pb::CompleteRequest {
                    id: Some(target.clone()),
                    fencing_token: token,
                    response: Some(response()),
                }],
            })
            .await
            .expect("the batch is answered")
            .into_inner();
        let Some(pb::batch_complete_result::Result::Error(status)) = &batch.results[0].result
        else {
            panic!("batch item not refused: {batch:?}");
        };
        assert_eq!(
            item_reason(status),
            (Code::PermissionDenied as i32, "NAMESPACE_FORBIDDEN".into())
        );
        denials.push(
            answers
                .into_iter()
                .map(|status| {
                    (
                        status.code(),
                        status.message().to_owned(),
                        status.details().to_vec(),
                    )
                })
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(
        denials[0], denials[1],
        "existing and missing records are refused alike"
    );

    // Nothing was written: one row, untouched.
    assert_eq!(secured.db.row_count().await, 1);
    let after = get(&mut owner, &existing).await.unwrap();
    assert_eq!(after, before, "the owner's record is unchanged");
    // And the owner still holds it: its Complete goes through.
    owner
        .complete(pb::CompleteRequest {
            id: Some(existing.clone()),
            fencing_token: token,
            response: Some(response()),
        })
        .await
        .expect("the owner completes its own attempt");
}

#[tokio::test]
async fn batch_items_are_checked_one_by_one() {
    let secured = Secured::start().await;
    let mut client = secured.mtls(PAYMENTS_SPIFFE).await;
    let own_1 = id("payments", "batch-own-0001");
    let foreign = id("refunds", "batch-foreign-1");
    let own_2 = id("payments", "batch-own-0002");

    let results = client
        .batch_acquire(pb::BatchAcquireRequest {
            requests: vec![
                acquire_request(&own_1),
                acquire_request(&foreign),
                acquire_request(&own_2),
            ],
        })
        .await
        .unwrap()
        .into_inner()
        .results;

    use pb::batch_acquire_result::Result as Item;
    let mut tokens = Vec::new();
    for (index, result) in results.iter().enumerate() {
        match (&result.result, index) {
            (Some(Item::Response(response)), 0 | 2) => match &response.outcome {
                Some(Outcome::Acquired(acquired)) => tokens.push(acquired.fencing_token),
                other => panic!("item {index}: {other:?}"),
            },
            (Some(Item::Error(status)), 1) => {
                assert_eq!(
                    item_reason(status),
                    (Code::PermissionDenied as i32, "NAMESPACE_FORBIDDEN".into())
                );
            }
            (other, _) => panic!("item {index}: {other:?}"),
        }
    }
    assert_eq!(
        secured.db.row_count().await,
        2,
        "only the two allowed items wrote"
    );

    let results = client
        .batch_complete(pb::BatchCompleteRequest {
            requests: [(&own_1, tokens[0]), (&foreign, 1), (&own_2, tokens[1])]
                .into_iter()
                .map(|(id, fencing_token)| pb::CompleteRequest {
                    id: Some(id.clone()),
                    fencing_token,
                    response: Some(response()),
                })
                .collect(),
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    use pb::batch_complete_result::Result as Done;
    assert!(
        matches!(results[0].result, Some(Done::Response(_))),
        "{results:?}"
    );
    assert!(
        matches!(results[2].result, Some(Done::Response(_))),
        "{results:?}"
    );
    let Some(Done::Error(status)) = &results[1].result else {
        panic!("{results:?}");
    };
    assert_eq!(
        item_reason(status),
        (Code::PermissionDenied as i32, "NAMESPACE_FORBIDDEN".into())
    );
}

#[tokio::test]
async fn a_reader_may_get_but_never_write() {
    let secured = Secured::start().await;
    let mut owner = secured.mtls(PAYMENTS_SPIFFE).await;
    let mut reader = secured.bearer(SUPPORT_TOKEN).await;
    let record = id("payments", "read-only-0001");
    let token = acquired(&mut owner, &record).await;

    let seen = get(&mut reader, &record).await.expect("a reader may Get");
    assert_eq!(seen.fencing_token, token);

    refused(
        acquire(&mut reader, &id("payments", "read-only-0002")).await,
        Code::PermissionDenied,
        "NAMESPACE_FORBIDDEN",
    );
    let complete = reader
        .complete(pb::CompleteRequest {
            id: Some(record.clone()),
            fencing_token: token,
            response: Some(response()),
        })
        .await;
    refused(complete, Code::PermissionDenied, "NAMESPACE_FORBIDDEN");
    let renew = reader
        .renew(pb::RenewRequest {
            id: Some(record.clone()),
            fencing_token: token,
            lease: None,
        })
        .await;
    refused(renew, Code::PermissionDenied, "NAMESPACE_FORBIDDEN");
    assert_eq!(secured.db.row_count().await, 1);
}

#[tokio::test]
async fn a_squatter_cannot_take_a_key_of_another_namespace_first() {
    let secured = Secured::start().await;
    let mut squatter = secured.bearer(&secured.rsa.token(REFUNDS_SA)).await;
    let mut owner = secured.bearer(&secured.rsa.token(PAYMENTS_SA)).await;
    let key = id("payments", "squatted-key-01");

    refused(
        acquire(&mut squatter, &key).await,
        Code::PermissionDenied,
        "NAMESPACE_FORBIDDEN",
    );

    // The owner's first request runs its logic: nobody answered it before.
    acquired(&mut owner, &key).await;
}
