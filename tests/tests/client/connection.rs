//! Connection options: TLS and several endpoints.

use std::time::Duration;

use idempotency_client::{Acquisition, Client, ClientOptions, Error, RetryPolicy};
use idempotency_server::{
    domain::Limits,
    engine::Engine,
    grpc::{GrpcService, service::IdempotencyServiceServer},
    store::Store,
};
use idempotency_tests::{TcpProxy, TestDb, TestServer, server_pool};
use tonic::transport::{
    Certificate, ClientTlsConfig, Identity, Server, ServerTlsConfig, server::TcpIncoming,
};

use crate::support::*;

#[tokio::test]
async fn the_client_speaks_tls_to_a_server_whose_certificate_it_trusts() {
    let db = TestDb::new().await;
    let certified = rcgen::generate_simple_self_signed(vec!["idempotency.test".into()]).unwrap();
    let (cert_pem, key_pem) = (certified.cert.pem(), certified.signing_key.serialize_pem());
    let engine = Engine::new(
        Store::new(server_pool(db.connect_options())),
        Limits::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        Server::builder()
            .tls_config(ServerTlsConfig::new().identity(Identity::from_pem(&cert_pem, &key_pem)))
            .unwrap()
            .add_service(IdempotencyServiceServer::new(GrpcService::new(
                engine,
                idempotency_server::grpc::metrics::CallSeries::new(
                    idempotency_server::metrics::NamespaceLabels::new(10),
                    &idempotency_server::telemetry::MetricsRecorder::install(),
                ),
                idempotency_server::grpc::auth::Authorizer::default(),
            )))
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    let trusting = Client::builder()
        .endpoint(format!("https://{addr}"))
        .tls(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&cert_pem))
                .domain_name("idempotency.test"),
        )
        .connect()
        .await
        .expect("TLS handshake with a trusted certificate");
    let distrusting = Client::builder()
        .endpoint(format!("https://{addr}"))
        .tls(
            ClientTlsConfig::new()
                .with_webpki_roots()
                .domain_name("idempotency.test"),
        )
        .retry(RetryPolicy::none())
        .connect_lazy()
        .unwrap();

    let outcome = trusting.acquire(&request("tls")).await.unwrap();
    let refused = distrusting.acquire(&request("tls")).await;

    assert!(matches!(outcome, Acquisition::Proceed(_)));
    assert!(
        matches!(refused, Err(Error::Unavailable { .. })),
        "{refused:?}"
    );
    server.abort();
}

/// A client balanced over `endpoints`, with two attempts per call: a call
/// whose first attempt draws an endpoint that went away must get its second
/// to a live one.
fn balanced_client<const N: usize>(endpoints: [std::net::SocketAddr; N]) -> Client {
    Client::builder()
        .endpoints(endpoints.map(|addr| format!("http://{addr}")))
        .connect_lazy()
        .unwrap()
        .with_options(ClientOptions {
            timeout: Duration::from_secs(2),
            retry: RetryPolicy {
                max_attempts: 2,
                ..RetryPolicy::default()
            },
            ..ClientOptions::default()
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_endpoints_are_balanced_and_one_going_away_is_survived() {
    // A database each, so that each server's rows show which calls it served.
    let (first_db, second_db) = (TestDb::new().await, TestDb::new().await);
    let first = TestServer::start(&first_db).await;
    let second = TestServer::start(&second_db).await;
    let client = balanced_client([first.addr, second.addr]);
    // Calls go to both servers (each call picks one at random, once both
    // are connected): stop as soon as each served one, or give up.
    for n in 0..200 {
        let outcome = client
            .acquire(&request(&format!("balanced{n}")))
            .await
            .unwrap();
        assert!(matches!(outcome, Acquisition::Proceed(_)));
        if n >= 10 && first_db.row_count().await > 0 && second_db.row_count().await > 0 {
            break;
        }
    }
    assert!(
        first_db.row_count().await > 0,
        "the first server got no call"
    );
    assert!(
        second_db.row_count().await > 0,
        "the second server got no call"
    );

    first.stop().await;

    // Drawn at random, each of two attempts would go to the stopped server
    // half the time: a quarter of these calls would fail.
    for n in 0..20 {
        proceed(&client, &request(&format!("survivor{n}"))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_three_endpoints_one_going_away_is_survived() {
    // The balancer draws two of three per attempt. Once the stopped one
    // refused a call, a draw that holds it takes the other: no attempt goes
    // to it for 2 s, so every call's second attempt reaches a live server.
    let dbs = [
        TestDb::new().await,
        TestDb::new().await,
        TestDb::new().await,
    ];
    let servers = [
        TestServer::start(&dbs[0]).await,
        TestServer::start(&dbs[1]).await,
        TestServer::start(&dbs[2]).await,
    ];
    let client = balanced_client(servers.each_ref().map(|server| server.addr));
    let mut n = 0;
    while dbs[0].row_count().await == 0 {
        n += 1;
        assert!(n < 300, "the first server got no call in 300");
        proceed(&client, &request(&format!("three{n}"))).await;
    }
    let [first, second, third] = servers;
    first.stop().await;

    // Drawn at random, a third of first attempts and of retries would go to
    // the stopped server: about one call in nine would fail both attempts.
    for n in 0..40 {
        proceed(&client, &request(&format!("of-three{n}"))).await;
    }
    assert!(dbs[1].row_count().await > 0 && dbs[2].row_count().await > 0);
    second.stop().await;
    third.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_comes_back_gets_calls_again() {
    let (first_db, second_db) = (TestDb::new().await, TestDb::new().await);
    let first = TestServer::start(&first_db).await;
    let second = TestServer::start(&second_db).await;
    // The first endpoint is a proxy: cut, its address refuses connections;
    // restored, it listens on the same address again.
    let proxy = TcpProxy::start(first.addr).await;
    let client = balanced_client([proxy.addr, second.addr]);
    let mut n = 0;
    let mut acquire = async || {
        n += 1;
        proceed(&client, &request(&format!("back{n}"))).await;
    };
    while first_db.row_count().await == 0 {
        acquire().await;
    }

    proxy.cut().await;
    for _ in 0..20 {
        acquire().await;
    }
    // Past the while an endpoint whose call failed is avoided (2 s), still
    // gone: the call that finds out gets its retry to the other one.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    for _ in 0..20 {
        acquire().await;
    }
    proxy.restore().await;
    let before = first_db.row_count().await;
    // Avoided for 2 s after its last failure, then drawn again: well within
    // this long it serves calls again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while first_db.row_count().await == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the endpoint that came back got no call in 10 s"
        );
        acquire().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.stop().await;
    second.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_connection_dropped_before_it_went_out_is_sent_again() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    // Cut, the proxy drops its connections at once (no GOAWAY: a server
    // killed, a proxy restarted); restored, it accepts new ones.
    let proxy = TcpProxy::start(server.addr).await;
    let client = client_at(proxy.addr);
    // The call right after the drop races the client's noticing it: hyper
    // either cancels it ("connection closed", reported as CANCELLED) or
    // reconnects first. Each round gives the race another chance; every
    // call must get through on a later attempt.
    for round in 0..30 {
        proceed(&client, &request(&format!("before{round}"))).await;
        proxy.cut().await;
        proxy.restore().await;
        proceed(&client, &request(&format!("after{round}"))).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_the_first_call_reconnects() {
    // No waiting between reconnections (grpcio's would grow to two minutes
    // and fail calls meanwhile: the Python client caps it): a call made as
    // soon as the service is back reaches it, here after 3 s away.
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let proxy = TcpProxy::start(server.addr).await;
    let client = client_at(proxy.addr).with_options(ClientOptions {
        retry: RetryPolicy::none(),
        ..ClientOptions::default()
    });
    proceed(&client, &request("before-the-outage")).await;
    proxy.cut().await;
    for n in 0..30 {
        let outcome = client.acquire(&request(&format!("outage{n}"))).await;
        assert!(
            matches!(outcome, Err(Error::Unavailable { .. })),
            "{outcome:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.restore().await;
    proceed(&client, &request("after-the-outage")).await;
    server.stop().await;
}

/// A client of a service that accepts connections and never answers (a hung
/// process, a black-holed route): no refusal, no reset.
async fn client_of_a_silent_service(batching: Option<idempotency_client::Batching>) -> Client {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    Client::builder()
        .endpoint(format!("http://{addr}"))
        .timeout(Duration::from_millis(300))
        .retry(RetryPolicy::none())
        .batching(batching)
        .connect_lazy()
        .unwrap()
}

#[tokio::test]
async fn a_call_to_a_service_that_never_answers_fails_as_unavailable_once_its_timeout_passes() {
    for batching in [Some(idempotency_client::Batching::default()), None] {
        let client = client_of_a_silent_service(batching.clone()).await;
        for _ in 0..5 {
            let outcome =
                tokio::time::timeout(Duration::from_secs(10), client.acquire(&request("silent")))
                    .await
                    .expect("the client's own timeout ends the call");

            // Unavailable, so that a caller's fail-open policy applies and
            // the HTTP layer answers 503, whichever of tonic's deadline and
            // the client's fired first.
            match outcome {
                Err(error @ Error::Unavailable { .. }) => assert!(error.is_unavailable()),
                other => panic!("batching {batching:?}: {other:?}"),
            }
        }
    }
}
