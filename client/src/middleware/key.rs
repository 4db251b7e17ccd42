//! The `Idempotency-Key` header (HTTP) or `idempotency-key` metadata (gRPC,
//! which travels as the same HTTP/2 header).

use http::HeaderMap;

/// The header's name, as HTTP/2 and gRPC metadata spell it.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// What the request says about its key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeyHeader {
    Missing,
    Malformed(&'static str),
    Present(String),
}

/// Reads the key. The IETF draft sends it as a structured-field string
/// (`"…"`); many clients send it bare: both are accepted. The key itself must
/// meet the service's contract: 8-128 characters in 0x21-0x7E.
pub(crate) fn read(headers: &HeaderMap) -> KeyHeader {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return KeyHeader::Missing;
    };
    if values.next().is_some() {
        return KeyHeader::Malformed("the Idempotency-Key header must appear once");
    }
    let Ok(value) = value.to_str() else {
        return KeyHeader::Malformed("the Idempotency-Key must be printable ASCII");
    };
    let value = value.trim();
    let key = value
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or(value);
    if !(8..=128).contains(&key.len()) {
        return KeyHeader::Malformed("the Idempotency-Key must be 8 to 128 characters");
    }
    if !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return KeyHeader::Malformed("the Idempotency-Key must be printable ASCII without spaces");
    }
    KeyHeader::Present(key.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(IDEMPOTENCY_KEY, value.parse().unwrap());
        }
        headers
    }

    #[test]
    fn bare_and_quoted_keys_are_accepted() {
        assert_eq!(
            read(&headers(&["abcdefgh"])),
            KeyHeader::Present("abcdefgh".into())
        );
        assert_eq!(
            read(&headers(&["\"8e03978e-40d5\""])),
            KeyHeader::Present("8e03978e-40d5".into())
        );
    }

    #[test]
    fn missing_short_long_spaced_and_repeated_keys_are_told_apart() {
        assert_eq!(read(&HeaderMap::new()), KeyHeader::Missing);
        for bad in [
            &["short"][..],
            &["a".repeat(129).as_str()],
            &["abcd efgh"],
            &["abcdefgh", "abcdefgh"],
        ] {
            assert!(
                matches!(read(&headers(bad)), KeyHeader::Malformed(_)),
                "{bad:?}"
            );
        }
    }
}
