//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the
//! `traceparent` header that clients send with each call and the service
//! reads, parsed once here for both.
//!
//! `traceparent: 00-<trace-id: 32 hex>-<parent-id: 16 hex>-<flags: 2 hex>`.
//! Parsing follows the spec's rules for a receiver: lowercase hex only, an
//! all-zero trace id or parent id is invalid, version `ff` is invalid, and a
//! version newer than `00` is read as far as the fields `00` defines (the
//! header may be longer, with a `-` after them). An invalid header is `None`:
//! the receiver ignores it and starts a trace of its own, as if none came.
//! `tracestate` is not read: nothing here uses vendor state.

use std::fmt;

/// The name of the header (and gRPC metadata key).
pub const TRACEPARENT: &str = "traceparent";

/// The length of a version-00 `traceparent` value.
pub const TRACEPARENT_LEN: usize = 55;

/// A trace's id: 16 bytes, never all zero. Displays as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId([u8; 16]);

/// A span's id (the caller's `parent-id`): 8 bytes, never all zero.
/// Displays as 16 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId([u8; 8]);

/// What one `traceparent` carries: the trace, the caller's span in it, and
/// the flags (bit 0: sampled).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TraceContext {
    trace_id: TraceId,
    parent_id: SpanId,
    flags: u8,
}

/// The `sampled` bit of the trace flags.
const SAMPLED: u8 = 0x01;

impl TraceId {
    /// A random trace id (never all zero).
    pub fn random() -> Self {
        Self(nonzero(|| fastrand::u128(..).to_be_bytes()))
    }

    /// The id from its bytes; `None` when all are zero (invalid).
    pub fn from_bytes(bytes: [u8; 16]) -> Option<Self> {
        (bytes != [0; 16]).then_some(Self(bytes))
    }

    /// The id's bytes.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }
}

impl SpanId {
    /// A random span id (never all zero).
    pub fn random() -> Self {
        Self(nonzero(|| fastrand::u64(..).to_be_bytes()))
    }

    /// The id from its bytes; `None` when all are zero (invalid).
    pub fn from_bytes(bytes: [u8; 8]) -> Option<Self> {
        (bytes != [0; 8]).then_some(Self(bytes))
    }

    /// The id's bytes.
    pub fn to_bytes(self) -> [u8; 8] {
        self.0
    }
}

/// Random bytes until they are not all zero (one draw in 2^64 repeats).
fn nonzero<const N: usize>(mut draw: impl FnMut() -> [u8; N]) -> [u8; N] {
    loop {
        let bytes = draw();
        if bytes != [0; N] {
            return bytes;
        }
    }
}

impl TraceContext {
    /// A context from its parts.
    pub fn new(trace_id: TraceId, parent_id: SpanId, sampled: bool) -> Self {
        Self {
            trace_id,
            parent_id,
            flags: if sampled { SAMPLED } else { 0 },
        }
    }

    /// A new trace: random ids, sampled (a receiver that exports spans
    /// keeps it).
    pub fn random() -> Self {
        Self::new(TraceId::random(), SpanId::random(), true)
    }

    /// Parses a `traceparent` value (see the module docs); `None` when invalid.
    pub fn parse(value: impl AsRef<[u8]>) -> Option<Self> {
        let value = value.as_ref();
        let version = hex_byte(value.get(0..2)?)?;
        // Version ff is forbidden; 00 is exactly 55 characters; a later
        // version may be longer, with a `-` after the fields 00 defines.
        let fits = match version {
            0xff => false,
            0x00 => value.len() == TRACEPARENT_LEN,
            _ => {
                value.len() == TRACEPARENT_LEN
                    || (value.len() > TRACEPARENT_LEN && value[TRACEPARENT_LEN] == b'-')
            }
        };
        if !fits || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let mut trace_id = [0; 16];
        hex_into(&value[3..35], &mut trace_id)?;
        let mut parent_id = [0; 8];
        hex_into(&value[36..52], &mut parent_id)?;
        let flags = hex_byte(&value[53..55])?;
        Some(Self {
            trace_id: TraceId::from_bytes(trace_id)?,
            parent_id: SpanId::from_bytes(parent_id)?,
            // Of a later version's flags, only those 00 defines are read.
            flags: if version == 0 { flags } else { flags & SAMPLED },
        })
    }

    /// The trace this call belongs to.
    pub fn trace_id(&self) -> TraceId {
        self.trace_id
    }

    /// The sender's span: the parent of the receiver's.
    pub fn parent_id(&self) -> SpanId {
        self.parent_id
    }

    /// The trace flags (bit 0: sampled).
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the sender records this trace.
    pub fn is_sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The same trace and flags, under another parent span: what a
    /// participant that made a span of its own sends on.
    pub fn with_parent(self, parent_id: SpanId) -> Self {
        Self { parent_id, ..self }
    }

    /// The `traceparent` value (version 00), without allocating.
    pub fn to_header(&self) -> [u8; TRACEPARENT_LEN] {
        let mut out = [b'-'; TRACEPARENT_LEN];
        out[0..2].copy_from_slice(b"00");
        hex_out(&self.trace_id.0, &mut out[3..35]);
        hex_out(&self.parent_id.0, &mut out[36..52]);
        hex_out(&[self.flags], &mut out[53..55]);
        out
    }
}

impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let header = self.to_header();
        f.write_str(std::str::from_utf8(&header).map_err(|_| fmt::Error)?)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_out(bytes: &[u8], out: &mut [u8]) {
    for (byte, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = HEX[usize::from(byte >> 4)];
        pair[1] = HEX[usize::from(byte & 0x0f)];
    }
}

/// Writes `bytes` as lowercase hex, without allocating.
fn write_hex(bytes: &[u8], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let mut buffer = [0u8; 32];
    let out = &mut buffer[..bytes.len() * 2];
    hex_out(bytes, out);
    f.write_str(std::str::from_utf8(out).map_err(|_| fmt::Error)?)
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(&self.0, f)
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(&self.0, f)
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(&self.0, f)
    }
}

impl fmt::Debug for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(&self.0, f)
    }
}

/// One lowercase hex digit's value (uppercase is invalid in `traceparent`).
fn hex_digit(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(pair: &[u8]) -> Option<u8> {
    match pair {
        [high, low] => Some(hex_digit(*high)? << 4 | hex_digit(*low)?),
        _ => None,
    }
}

fn hex_into(text: &[u8], out: &mut [u8]) -> Option<()> {
    for (pair, byte) in text.chunks_exact(2).zip(out.iter_mut()) {
        *byte = hex_byte(pair)?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_version_00_header_parses_and_prints_back_the_same() {
        let context = TraceContext::parse(VALID).expect("valid");
        assert_eq!(
            context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(context.parent_id().to_string(), "00f067aa0ba902b7");
        assert!(context.is_sampled());
        assert_eq!(context.to_string(), VALID);
        let unsampled = VALID.replace("-01", "-00");
        assert!(!TraceContext::parse(&unsampled).unwrap().is_sampled());
    }

    #[test]
    fn invalid_headers_are_none() {
        let cases = [
            "",
            "00",
            // Uppercase hex.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
            // All-zero ids.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Version ff, and a version that is not hex.
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // Version 00 is exactly 55 characters.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            // Wrong separators, non-hex characters.
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e473z-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ];
        for case in cases {
            assert_eq!(TraceContext::parse(case), None, "{case:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_as_far_as_version_00_goes() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03";
        let context = TraceContext::parse(later).expect("same length");
        assert_eq!(
            context.trace_id(),
            TraceContext::parse(VALID).unwrap().trace_id()
        );
        // Only the flags 00 defines are kept, and it is sent on as 00.
        assert_eq!(context.flags(), 0x01);
        assert_eq!(context.to_string(), VALID);
        let longer = format!("{}-what-comes-later", later.replace("01-", "cc-"));
        assert!(TraceContext::parse(&longer).is_some(), "{longer}");
        // Longer without a `-` after the known fields is invalid.
        assert_eq!(TraceContext::parse(format!("{later}x")), None);
    }

    #[test]
    fn random_contexts_are_valid_and_distinct() {
        let (a, b) = (TraceContext::random(), TraceContext::random());
        assert_ne!(a.trace_id(), b.trace_id());
        assert_eq!(TraceContext::parse(a.to_header()), Some(a));
        assert!(a.is_sampled());
    }

    #[test]
    fn a_new_parent_keeps_the_trace_and_its_flags() {
        let context = TraceContext::parse(VALID).unwrap();
        let child = context.with_parent(SpanId::random());
        assert_eq!(child.trace_id(), context.trace_id());
        assert_eq!(child.flags(), context.flags());
        assert_ne!(child.parent_id(), context.parent_id());
    }
}
