//! Hand-made messages for hostile-input tests: bytes a well-behaved client
//! library would never encode, sent as they are, and the process's memory
//! read from /proc to bound what they cost.

use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{WireType, encode_key, encode_varint};
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    transport::Channel,
};

/// Sends and receives message bytes untouched.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining())))
    }
}

/// Calls `method` of the service with `message` as it is.
pub async fn call(channel: Channel, method: &str, message: Bytes) -> Result<Bytes, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = format!("/idempotency.v1.IdempotencyService/{method}")
        .parse()
        .unwrap();
    grpc.unary(tonic::Request::new(message), path, RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// Field `number` holding `bytes`, length-delimited.
pub fn field(number: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 6);
    encode_key(number, WireType::LengthDelimited, &mut out);
    encode_varint(bytes.len() as u64, &mut out);
    out.extend_from_slice(bytes);
    out
}

/// A BatchAcquire of `items` empty Acquires: two bytes each.
pub fn empty_batch_acquire(items: usize) -> Bytes {
    [0x0a, 0x00].repeat(items).into()
}

/// A Complete of `message` (a valid CompleteRequest without its response)
/// whose response has `headers` headers `h<i>: v`.
pub fn complete_with_headers(message: &impl prost::Message, headers: usize) -> Bytes {
    let mut response = Vec::new();
    for i in 0..headers {
        let name = format!("h{i}");
        let mut entry = field(1, name.as_bytes());
        entry.extend(field(2, b"v"));
        response.extend(field(3, &entry));
    }
    let mut out = message.encode_to_vec();
    out.extend(field(3, &response));
    out.into()
}

/// This process's memory, from /proc/self/status.
pub struct Memory;

impl Memory {
    /// Resets the peak resident set size (VmHWM) to the current one.
    pub fn reset_peak() {
        std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM");
    }

    /// Peak resident set size since the last reset, in MiB.
    pub fn peak_mib() -> f64 {
        Self::field("VmHWM:")
    }

    /// Resident set size now, in MiB.
    pub fn rss_mib() -> f64 {
        Self::field("VmRSS:")
    }

    fn field(name: &str) -> f64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let kib: f64 = status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in /proc/self/status"));
        kib / 1024.0
    }
}
