//! A BatchStream message on the wire: its id, deadline, trace context and
//! batch, read without decoding the batch (admission counts its items on
//! the wire first), and its answer, the batch call's reply encoded in place.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use prost::{
    Message,
    encoding::{WireType, encode_key, encode_varint},
};
use tonic::Status;

use crate::domain::InvalidField;

use super::super::status::{to_rpc_status, to_status};

/// `BatchStreamRequest`, with its batch kept as the bytes of the embedded
/// message (a message field and a bytes field look alike on the wire). A
/// batch given twice is taken from its last occurrence, as protobuf takes
/// the last member of a oneof; encoders never split an embedded message.
#[derive(Clone, PartialEq, Message)]
struct Envelope {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(message, optional, tag = "2")]
    timeout: Option<prost_types::Duration>,
    #[prost(string, tag = "3")]
    traceparent: String,
    #[prost(oneof = "Batch", tags = "4, 5")]
    batch: Option<Batch>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Batch {
    #[prost(bytes = "bytes", tag = "4")]
    Acquire(Bytes),
    #[prost(bytes = "bytes", tag = "5")]
    Complete(Bytes),
}

/// Which batch call a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Acquire,
    Complete,
}

impl Kind {
    /// The unary call's path.
    pub(super) fn path(self) -> &'static str {
        match self {
            Self::Acquire => "/idempotency.v1.IdempotencyService/BatchAcquire",
            Self::Complete => "/idempotency.v1.IdempotencyService/BatchComplete",
        }
    }

    /// The unary call's RPC, as spans, logs and metrics name it.
    pub(super) fn rpc(self) -> &'static str {
        match self {
            Self::Acquire => "BatchAcquire",
            Self::Complete => "BatchComplete",
        }
    }

    /// `BatchStreamResponse`'s field for this kind's answer.
    fn answer_tag(self) -> u32 {
        match self {
            Self::Acquire => 2,
            Self::Complete => 3,
        }
    }
}

/// `BatchStreamResponse.error`.
const ERROR_TAG: u32 = 4;

/// A message read from the stream.
#[derive(Debug)]
pub(super) struct Request {
    pub id: u64,
    /// The message's own answer, when it is invalid as a whole.
    pub content: Result<Content, Status>,
}

/// A valid message: the batch call it stands for.
#[derive(Debug)]
pub(super) struct Content {
    pub kind: Kind,
    pub batch: Bytes,
    pub timeout: Option<Duration>,
    /// As sent; the call's span parses it as it parses a unary call's metadata.
    pub traceparent: String,
}

/// Longest `traceparent` passed on (room for a future version's fields).
const MAX_TRACEPARENT_BYTES: usize = 256;

/// Reads a message; `Err` when it is not valid protobuf.
pub(super) fn read(message: Bytes) -> Result<Request, prost::DecodeError> {
    let envelope = Envelope::decode(message)?;
    // A valid traceparent is 55 characters: a longer one is ignored (a
    // trace of its own) and not kept past the message's charge, which ends
    // before the call is answered.
    let mut traceparent = envelope.traceparent;
    if traceparent.len() > MAX_TRACEPARENT_BYTES {
        traceparent = String::new();
    }
    let content = content(envelope.batch, envelope.timeout).map(|(kind, batch, timeout)| Content {
        kind,
        batch,
        timeout,
        traceparent,
    });
    Ok(Request {
        id: envelope.id,
        content,
    })
}

type Parts = (Kind, Bytes, Option<Duration>);

fn content(batch: Option<Batch>, timeout: Option<prost_types::Duration>) -> Result<Parts, Status> {
    let timeout = timeout.map(positive).transpose()?;
    match batch {
        Some(Batch::Acquire(batch)) => Ok((Kind::Acquire, batch, timeout)),
        Some(Batch::Complete(batch)) => Ok((Kind::Complete, batch, timeout)),
        None => Err(invalid("batch", "required: one of acquire or complete")),
    }
}

fn positive(timeout: prost_types::Duration) -> Result<Duration, Status> {
    let normal = timeout.seconds >= 0 && (0..1_000_000_000).contains(&timeout.nanos);
    normal
        .then(|| Duration::try_from(timeout).ok())
        .flatten()
        .filter(|timeout| !timeout.is_zero())
        .ok_or_else(|| invalid("timeout", "must be positive"))
}

fn invalid(field: &str, description: &str) -> Status {
    to_status("BatchStream", InvalidField::new(field, description).into())
}

/// The answer carrying a batch call's reply, as a gRPC message (its prefix
/// included), encoded once, in place.
pub(super) fn answer(id: u64, kind: Kind, reply: &impl Message) -> Bytes {
    let length = reply.encoded_len();
    let mut answer = start(id, length);
    encode_key(kind.answer_tag(), WireType::LengthDelimited, &mut answer);
    encode_varint(length as u64, &mut answer);
    reply.encode_raw(&mut answer);
    framed(answer)
}

/// The answer for a message that failed as a whole, as a gRPC message.
pub(super) fn error(id: u64, status: &Status) -> Bytes {
    let rpc = to_rpc_status(status);
    let mut answer = start(id, rpc.encoded_len());
    prost::encoding::message::encode(ERROR_TAG, &rpc, &mut answer);
    framed(answer)
}

/// The gRPC message prefix: a compression flag and a 4-byte length.
const PREFIX_BYTES: usize = 5;

/// A buffer for an answer of about `body` bytes: room for the message
/// prefix, then the id.
fn start(id: u64, body: usize) -> BytesMut {
    let mut answer = BytesMut::with_capacity(PREFIX_BYTES + body + 24);
    answer.put_bytes(0, PREFIX_BYTES);
    prost::encoding::uint64::encode(1, &id, &mut answer);
    answer
}

/// Fills in the prefix: uncompressed, and the message's length.
fn framed(mut answer: BytesMut) -> Bytes {
    let length = (answer.len() - PREFIX_BYTES) as u32;
    answer[1..PREFIX_BYTES].copy_from_slice(&length.to_be_bytes());
    answer.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::pb;

    fn unframed(mut message: Bytes) -> Bytes {
        assert_eq!(message[0], 0);
        assert_eq!(
            u32::from_be_bytes(message[1..5].try_into().unwrap()) as usize,
            message.len() - 5
        );
        message.split_off(5)
    }

    fn batch() -> pb::BatchAcquireRequest {
        pb::BatchAcquireRequest {
            requests: vec![pb::AcquireRequest::default(); 2],
        }
    }

    #[test]
    fn a_message_is_read_with_its_batch_as_sent() {
        let sent = pb::BatchStreamRequest {
            id: 7,
            timeout: Some(prost_types::Duration {
                seconds: 1,
                nanos: 500_000_000,
            }),
            traceparent: "00-abc".into(),
            batch: Some(pb::batch_stream_request::Batch::Acquire(batch())),
        };
        let message = read(sent.encode_to_vec().into()).unwrap();
        assert_eq!(message.id, 7);
        let content = message.content.unwrap();
        assert_eq!(content.kind, Kind::Acquire);
        assert_eq!(content.batch, batch().encode_to_vec());
        assert_eq!(content.timeout, Some(Duration::from_millis(1500)));
        assert_eq!(content.traceparent, "00-abc");
    }

    #[test]
    fn a_message_without_a_batch_or_with_a_bad_timeout_is_answered_alone() {
        let no_batch = pb::BatchStreamRequest {
            id: 3,
            ..Default::default()
        };
        let message = read(no_batch.encode_to_vec().into()).unwrap();
        assert_eq!(message.id, 3);
        assert_eq!(
            message.content.unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        for (seconds, nanos) in [(0, 0), (-1, 0), (0, -5), (1, 2_000_000_000)] {
            let bad_timeout = pb::BatchStreamRequest {
                id: 4,
                timeout: Some(prost_types::Duration { seconds, nanos }),
                batch: Some(pb::batch_stream_request::Batch::Acquire(batch())),
                ..Default::default()
            };
            let message = read(bad_timeout.encode_to_vec().into()).unwrap();
            let status = message.content.unwrap_err();
            assert_eq!(
                status.code(),
                tonic::Code::InvalidArgument,
                "{seconds} {nanos}"
            );
            assert!(format!("{:?}", to_rpc_status(&status)).contains("timeout"));
        }
    }

    #[test]
    fn answers_decode_as_the_contract_says() {
        let reply = pb::BatchAcquireResponse {
            results: vec![pb::BatchAcquireResult::default()],
        };
        let answer = answer(9, Kind::Acquire, &reply);
        let decoded = pb::BatchStreamResponse::decode(unframed(answer)).unwrap();
        assert_eq!(decoded.id, 9);
        assert_eq!(
            decoded.result,
            Some(pb::batch_stream_response::Result::Acquire(reply))
        );
        let completed = pb::BatchCompleteResponse::default();
        let answer = super::answer(10, Kind::Complete, &completed);
        let decoded = pb::BatchStreamResponse::decode(unframed(answer)).unwrap();
        assert_eq!(
            decoded.result,
            Some(pb::batch_stream_response::Result::Complete(completed))
        );
        let status = invalid("batch", "required");
        let decoded = pb::BatchStreamResponse::decode(unframed(error(u64::MAX, &status))).unwrap();
        assert_eq!(decoded.id, u64::MAX);
        let Some(pb::batch_stream_response::Result::Error(error)) = decoded.result else {
            panic!("an error answer");
        };
        assert_eq!(error.code, tonic::Code::InvalidArgument as i32);
        assert!(!error.details.is_empty());
    }
}
