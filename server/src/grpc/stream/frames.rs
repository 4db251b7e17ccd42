//! A stream's request messages, read one at a time, each charged to the
//! memory budget before its bytes are read.

use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt as _;
use tokio::time::Instant;
use tonic::{Code, Status, body::Body};

use super::super::{
    admission::{Charge, MemoryBudget},
    status::{reason, with_reason},
};
use super::End;

/// The gRPC message prefix: a compression flag and a 4-byte length.
const PREFIX_BYTES: usize = 5;

/// A stream's end for a message it could not read.
pub(super) fn invalid(message: String) -> Status {
    with_reason(Code::InvalidArgument, message, reason::INVALID_ARGUMENT)
}

/// The request body, as gRPC messages.
pub(super) struct Frames {
    body: Body,
    buffer: BytesMut,
    /// The message being read: its length, the charge taken for it, and
    /// when its prefix arrived.
    pending: Option<(usize, Charge, Instant)>,
    max_bytes: usize,
    budget: Arc<MemoryBudget>,
}

impl Frames {
    pub(super) fn new(body: Body, max_bytes: usize, budget: Arc<MemoryBudget>) -> Self {
        Self {
            body,
            buffer: BytesMut::new(),
            pending: None,
            max_bytes,
            budget,
        }
    }

    /// The next message and its charge; `None` once the caller closed its
    /// side. Cancel-safe: what was read stays for the next call.
    pub(super) async fn next(&mut self) -> Result<Option<(Bytes, Charge)>, End> {
        loop {
            if self.pending.is_none() && self.buffer.len() >= PREFIX_BYTES {
                self.pending = Some(self.admit()?);
            }
            if let Some((length, _, _)) = &self.pending
                && self.buffer.len() >= PREFIX_BYTES + *length
            {
                let (length, charge, _) = self.pending.take().expect("checked above");
                self.buffer.advance(PREFIX_BYTES);
                let message = self.buffer.split_to(length).freeze();
                return Ok(Some((message, charge)));
            }
            match self.body.frame().await {
                None if self.buffer.is_empty() => return Ok(None),
                None => {
                    return Err(End::BadMessage(invalid(
                        "the stream ended inside a message".into(),
                    )));
                }
                // The caller reset the stream, or its connection broke.
                Some(Err(_)) => return Err(End::Cancelled),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// When the message being read started arriving, if one is: its charge
    /// is held until it is all here, so its sender gets a bounded time.
    pub(super) fn started_at(&self) -> Option<Instant> {
        self.pending.as_ref().map(|(_, _, at)| *at)
    }

    /// Checks the prefix at the buffer's start and charges the message.
    fn admit(&self) -> Result<(usize, Charge, Instant), End> {
        let compressed = self.buffer[0];
        let length = u32::from_be_bytes(self.buffer[1..5].try_into().expect("four bytes")) as usize;
        if compressed != 0 {
            return Err(End::BadMessage(invalid(
                "compressed BatchStream messages are not accepted; send them uncompressed".into(),
            )));
        }
        if length > self.max_bytes {
            return Err(End::BadMessage(with_reason(
                Code::OutOfRange,
                format!(
                    "a BatchStream message is {length} bytes; the server takes at most {}",
                    self.max_bytes
                ),
                reason::MESSAGE_TOO_LARGE,
            )));
        }
        let charge = self.budget.try_charge(length).ok_or_else(|| {
            End::Overloaded(with_reason(
                Code::Unavailable,
                "the server is at its memory budget for calls in flight (--max-in-flight-bytes); \
                 the next message was not read: send it again on a new stream, with backoff"
                    .into(),
                reason::OVERLOADED,
            ))
        })?;
        Ok((length, charge, Instant::now()))
    }
}
