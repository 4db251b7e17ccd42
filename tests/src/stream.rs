//! A BatchStream from the generated client, as a test drives it: messages
//! sent one by one, answers awaited one by one, and the stream's end.

use std::time::Duration;

use idempotency_client::pb::{
    self, batch_stream_request::Batch,
    idempotency_stream_service_client::IdempotencyStreamServiceClient,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Status, metadata::MetadataValue, transport::Channel};

/// How long a test waits for an answer or an end before it fails.
const PATIENCE: Duration = Duration::from_secs(15);

/// An open BatchStream.
pub struct OpenStream {
    sender: Option<mpsc::UnboundedSender<pb::BatchStreamRequest>>,
    answers: tonic::Streaming<pb::BatchStreamResponse>,
}

impl OpenStream {
    /// Opens a stream on `channel`, with `bearer` as its credential if given.
    pub async fn open(channel: Channel, bearer: Option<&str>) -> Result<Self, Status> {
        let (sender, receiver) = mpsc::unbounded_channel();
        let mut request = tonic::Request::new(UnboundedReceiverStream::new(receiver));
        if let Some(token) = bearer {
            let value: MetadataValue<_> = format!("Bearer {token}").parse().unwrap();
            request.metadata_mut().insert("authorization", value);
        }
        let answers = IdempotencyStreamServiceClient::new(channel)
            .max_decoding_message_size(64 * 1024 * 1024)
            .batch_stream(request)
            .await?
            .into_inner();
        Ok(Self {
            sender: Some(sender),
            answers,
        })
    }

    /// Sends a message as given.
    pub fn send(&self, message: pb::BatchStreamRequest) {
        self.sender
            .as_ref()
            .expect("the stream is not closed")
            .send(message)
            .expect("the stream's request is still read by tonic");
    }

    /// Sends a message if the stream still takes them (false once it ended).
    pub fn try_send(&self, message: pb::BatchStreamRequest) -> bool {
        self.sender
            .as_ref()
            .is_some_and(|sender| sender.send(message).is_ok())
    }

    /// Sends a BatchAcquire as message `id`.
    pub fn acquire(&self, id: u64, requests: Vec<pb::AcquireRequest>) {
        self.send(message(
            id,
            Batch::Acquire(pb::BatchAcquireRequest { requests }),
        ));
    }

    /// Sends a BatchComplete as message `id`.
    pub fn complete(&self, id: u64, requests: Vec<pb::CompleteRequest>) {
        self.send(message(
            id,
            Batch::Complete(pb::BatchCompleteRequest { requests }),
        ));
    }

    /// Closes the caller's side: no more messages.
    pub fn close(&mut self) {
        self.sender = None;
    }

    /// The next answer; fails the test if the stream ends first.
    pub async fn answer(&mut self) -> pb::BatchStreamResponse {
        match tokio::time::timeout(PATIENCE, self.answers.message()).await {
            Ok(Ok(Some(answer))) => answer,
            Ok(Ok(None)) => panic!("the stream ended (OK) before the next answer"),
            Ok(Err(status)) => panic!("the stream ended before the next answer: {status:?}"),
            Err(_) => panic!("no answer within {PATIENCE:?}"),
        }
    }

    /// The next answer if one comes within `wait`; `None` if none does.
    pub async fn answer_within(&mut self, wait: Duration) -> Option<pb::BatchStreamResponse> {
        match tokio::time::timeout(wait, self.answers.message()).await {
            Ok(Ok(Some(answer))) => Some(answer),
            Ok(other) => panic!("the stream ended: {other:?}"),
            Err(_) => None,
        }
    }

    /// The answers left, then how the stream ended.
    pub async fn end(mut self) -> (Vec<pb::BatchStreamResponse>, Result<(), Status>) {
        let mut answers = Vec::new();
        loop {
            match tokio::time::timeout(PATIENCE, self.answers.message()).await {
                Ok(Ok(Some(answer))) => answers.push(answer),
                Ok(Ok(None)) => return (answers, Ok(())),
                Ok(Err(status)) => return (answers, Err(status)),
                Err(_) => panic!("the stream did not end within {PATIENCE:?}"),
            }
        }
    }
}

/// A message of id `id` carrying `batch`.
pub fn message(id: u64, batch: Batch) -> pb::BatchStreamRequest {
    pb::BatchStreamRequest {
        id,
        batch: Some(batch),
        ..Default::default()
    }
}

/// The outcomes of a BatchAcquire answer; fails the test on anything else.
pub fn acquired(answer: pb::BatchStreamResponse) -> Vec<pb::BatchAcquireResult> {
    match answer.result {
        Some(pb::batch_stream_response::Result::Acquire(reply)) => reply.results,
        other => panic!("expected a BatchAcquire answer, got {other:?}"),
    }
}

/// The results of a BatchComplete answer; fails the test on anything else.
pub fn completed(answer: pb::BatchStreamResponse) -> Vec<pb::BatchCompleteResult> {
    match answer.result {
        Some(pb::batch_stream_response::Result::Complete(reply)) => reply.results,
        other => panic!("expected a BatchComplete answer, got {other:?}"),
    }
}

/// A whole message's error as the `tonic::Status` a unary call carries;
/// fails the test on anything else.
pub fn message_error(answer: pb::BatchStreamResponse) -> Status {
    use prost::Message as _;
    match answer.result {
        Some(pb::batch_stream_response::Result::Error(status)) => Status::with_details(
            tonic::Code::from_i32(status.code),
            status.message.clone(),
            status.encode_to_vec().into(),
        ),
        other => panic!("expected an error answer, got {other:?}"),
    }
}

/// Sends `messages` as they are (bytes, not necessarily protobuf) on a new
/// stream, closes it, and returns the answers and how it ended.
pub async fn raw_exchange(
    channel: Channel,
    messages: Vec<Vec<u8>>,
) -> (Vec<pb::BatchStreamResponse>, Result<(), Status>) {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("the channel is ready");
    let path = http::uri::PathAndQuery::from_static(
        "/idempotency.v1.IdempotencyStreamService/BatchStream",
    );
    let requests = tokio_stream::iter(messages);
    let opened = grpc
        .streaming(tonic::Request::new(requests), path, RawCodec)
        .await;
    let mut answers = match opened {
        Ok(response) => response.into_inner(),
        Err(status) => return (Vec::new(), Err(status)),
    };
    let mut received = Vec::new();
    loop {
        match tokio::time::timeout(PATIENCE, answers.message()).await {
            Ok(Ok(Some(answer))) => received.push(answer),
            Ok(Ok(None)) => return (received, Ok(())),
            Ok(Err(status)) => return (received, Err(status)),
            Err(_) => panic!("the stream did not end within {PATIENCE:?}"),
        }
    }
}

/// The contract's own codec for BatchStream.
type Contract = tonic_prost::ProstCodec<pb::BatchStreamRequest, pb::BatchStreamResponse>;

/// Sends byte vectors as messages unchanged; decodes answers as the contract's.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = pb::BatchStreamResponse;
    type Encoder = RawEncoder;
    type Decoder = <Contract as tonic::codec::Codec>::Decoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic::codec::Codec::decoder(&mut Contract::default())
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct RawEncoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        buffer: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        use bytes::BufMut as _;
        buffer.put_slice(&item);
        Ok(())
    }
}

/// A BatchStream spoken in raw HTTP/2 body bytes, below gRPC's framing: for
/// what no gRPC client sends (a message cut off, a compressed flag, a
/// `grpc-encoding` at open).
pub struct RawStream {
    sender: Option<mpsc::UnboundedSender<Result<http_body::Frame<bytes::Bytes>, Status>>>,
    response: http::Response<tonic::body::Body>,
}

impl RawStream {
    /// Opens a stream on `channel` with `headers` beside the gRPC ones.
    pub async fn open(channel: Channel, headers: &[(&'static str, &'static str)]) -> Self {
        use tower::ServiceExt as _;
        let (sender, receiver) = mpsc::unbounded_channel();
        let body = http_body_util::StreamBody::new(UnboundedReceiverStream::new(receiver));
        let mut request = http::Request::builder()
            .method(http::Method::POST)
            .uri(format!("http://localhost{STREAM_PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(tonic::body::Body::new(body))
            .expect("a valid request");
        let response = tokio::time::timeout(PATIENCE, channel.oneshot(request))
            .await
            .expect("the server answers the stream's headers")
            .expect("the connection carries the stream");
        Self {
            sender: Some(sender),
            response,
        }
    }

    /// Sends `bytes` as they are, as one DATA frame.
    pub fn send(&self, bytes: &[u8]) {
        self.sender
            .as_ref()
            .expect("the stream is not closed")
            .send(Ok(http_body::Frame::data(bytes::Bytes::copy_from_slice(
                bytes,
            ))))
            .expect("the request body is still read");
    }

    /// The answers, then how the stream ended, leaving the caller's side open
    /// (a trailers-only refusal at open gives no answers).
    pub async fn end(self) -> (Vec<pb::BatchStreamResponse>, Result<(), Status>) {
        use http_body_util::BodyExt as _;
        use prost::Message as _;
        let (parts, mut body) = self.response.into_parts();
        if let Some(status) = Status::from_header_map(&parts.headers) {
            return (Vec::new(), ok_or(status));
        }
        let mut data = bytes::BytesMut::new();
        let status = loop {
            let frame = tokio::time::timeout(PATIENCE, body.frame())
                .await
                .expect("the stream ends within the test's patience");
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(chunk) => data.extend_from_slice(&chunk),
                    Err(frame) => {
                        let trailers = frame.into_trailers().expect("data or trailers");
                        break Status::from_header_map(&trailers).expect("a grpc-status");
                    }
                },
                Some(Err(status)) => break status,
                None => panic!("the stream ended without trailers"),
            }
        };
        drop(self.sender);
        let mut answers = Vec::new();
        let mut data = data.freeze();
        while !data.is_empty() {
            assert_eq!(data[0], 0, "answers are not compressed");
            let length = u32::from_be_bytes(data[1..5].try_into().unwrap()) as usize;
            let message = data.split_to(5 + length).split_off(5);
            answers.push(pb::BatchStreamResponse::decode(message).expect("an answer"));
        }
        (answers, ok_or(status))
    }
}

const STREAM_PATH: &str = "/idempotency.v1.IdempotencyStreamService/BatchStream";

fn ok_or(status: Status) -> Result<(), Status> {
    if status.code() == tonic::Code::Ok {
        Ok(())
    } else {
        Err(status)
    }
}

/// `message` as gRPC frames it: uncompressed, its length, then its bytes.
pub fn framed(message: &pb::BatchStreamRequest) -> Vec<u8> {
    use prost::Message as _;
    let encoded = message.encode_to_vec();
    let mut framed = vec![0];
    framed.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    framed.extend_from_slice(&encoded);
    framed
}
