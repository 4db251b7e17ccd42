//! The example gRPC payments service (`client/examples/grpc_payments`)
//! behind the gRPC layer, on 127.0.0.1, and ways to call it.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use bytes::Bytes;
use idempotency_client::{
    Client,
    grpc::{GrpcConfig, GrpcIdempotencyLayer},
};
use tokio::task::JoinHandle;
use tonic::{Status, metadata::MetadataMap, transport::Channel};

use crate::raw::RawCodec;

/// The example's service, generated code and descriptor set, as the example builds them.
#[path = "../../client/examples/grpc_payments/payments.rs"]
pub mod payments;

pub use payments::{DESCRIPTOR_SET, Ledger, pb};

/// The payments service on 127.0.0.1, with reflection, behind the layer.
pub struct GrpcApp {
    pub addr: SocketAddr,
    pub ledger: Arc<Ledger>,
    task: JoinHandle<()>,
}

impl GrpcApp {
    /// `config` is completed with the subject (`x-user-id` metadata) and the
    /// excluded `/metadata/trace_id`, as the example does.
    pub async fn start(client: Client, config: GrpcConfig, bank_delay: Duration) -> Self {
        let config = config
            .exclude_json_pointer("/metadata/trace_id")
            .subject(|request| {
                let user = request.headers.get("x-user-id")?;
                user.to_str().ok().map(str::to_owned)
            });
        let service = payments::Payments::new(bank_delay);
        let ledger = service.ledger.clone();
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
        };
        let (reflection_v1, reflection_v1alpha) = (
            reflection().build_v1().unwrap(),
            reflection().build_v1alpha().unwrap(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = tonic::transport::Server::builder()
            .layer(GrpcIdempotencyLayer::new(client, config))
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(pb::payments_server::PaymentsServer::new(service));
        let task = tokio::spawn(async move {
            router
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        Self { addr, ledger, task }
    }

    /// A fresh connection to the app.
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// A generated client on a fresh connection.
    pub async fn client(&self) -> pb::payments_client::PaymentsClient<Channel> {
        pb::payments_client::PaymentsClient::new(self.channel().await)
    }
}

impl Drop for GrpcApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A request carrying `idempotency-key` (when given) and `x-user-id` metadata.
pub fn keyed<T>(message: T, key: Option<&str>, user: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    request
        .metadata_mut()
        .insert("x-user-id", user.parse().unwrap());
    request
}

/// A unary call of `path` with `message` as it is (any encoding a client
/// library might choose), with the metadata of [`keyed`]: the reply's
/// initial metadata and message bytes.
pub async fn call_raw(
    channel: Channel,
    path: &str,
    message: Bytes,
    key: Option<&str>,
    user: &str,
) -> Result<(MetadataMap, Bytes), Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = path.parse().unwrap();
    let response = grpc
        .unary(keyed(message, key, user), path, RawCodec)
        .await?;
    let (metadata, message, _) = response.into_parts();
    Ok((metadata, message))
}
