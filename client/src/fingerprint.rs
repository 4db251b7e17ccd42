//! Request fingerprints: SHA-256 of the canonical request, so that a key
//! reused with a different request is caught (FINGERPRINT_MISMATCH, HTTP 422)
//! while the same request written differently is not.
//!
//! JSON is canonicalized per RFC 8785 (JCS): object keys sorted by UTF-16
//! code units, no insignificant whitespace, numbers in their shortest
//! ECMAScript form. One departure: JCS writes every number as a double, so
//! two integers beyond 2^53 that differ only in their low digits (account
//! or snowflake ids) would share a fingerprint, and a retry carrying the
//! other id would be answered with the first request's response. A document
//! holding such an integer is written with its integers exact instead.
//! Integers beyond 64 bits and decimals finer than a double are still read
//! as doubles: send such values as strings. Volatile fields (trace ids,
//! client timestamps) are left out by JSON Pointer (RFC 6901), e.g.
//! `/meta/trace_id`.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Why a body could not be fingerprinted as JSON.
#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    /// The body is not JSON.
    #[error("the body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// An excluded path is not a JSON Pointer.
    #[error("{0:?} is not a JSON Pointer (it must be empty or start with '/')")]
    InvalidPointer(String),
    /// The value cannot be canonicalized (e.g. a number JCS cannot represent).
    #[error("the value cannot be canonicalized: {0}")]
    Canonicalization(String),
}

/// SHA-256 of raw bytes, for bodies that are not JSON.
pub fn bytes(body: &[u8]) -> Vec<u8> {
    Sha256::digest(body).to_vec()
}

/// SHA-256 of the canonical form of `value` without the `excluded` pointers.
pub fn json(value: &Value, excluded: &[&str]) -> Result<Vec<u8>, FingerprintError> {
    Ok(bytes(canonical_json(value, excluded)?.as_bytes()))
}

/// Parses `body` as JSON, then as [`json`].
pub fn json_bytes(body: &[u8], excluded: &[&str]) -> Result<Vec<u8>, FingerprintError> {
    json_body(body, excluded)
}

/// [`json_bytes`] for pointers held as `String`s (the HTTP layer's
/// configuration); the parsed value is pruned in place, without a copy.
pub(crate) fn json_body<S: AsRef<str>>(
    body: &[u8],
    excluded: &[S],
) -> Result<Vec<u8>, FingerprintError> {
    let value: Value = serde_json::from_slice(body).map_err(FingerprintError::InvalidJson)?;
    Ok(bytes(canonical_pruned(value, excluded)?.as_bytes()))
}

/// The RFC 8785 form of `value` without the `excluded` pointers.
pub fn canonical_json(value: &Value, excluded: &[&str]) -> Result<String, FingerprintError> {
    if excluded.is_empty() {
        return canonical(value);
    }
    canonical_pruned(value.clone(), excluded)
}

fn canonical_pruned<S: AsRef<str>>(
    mut value: Value,
    excluded: &[S],
) -> Result<String, FingerprintError> {
    // Every pointer names a place in the document as sent, but removing an
    // array element shifts the ones after it. So the deepest go first, and
    // of one array's elements the last first: `/a/0` and `/a/1` remove the
    // first two elements, not the first and the third.
    let mut pointers: Vec<&str> = excluded.iter().map(AsRef::as_ref).collect();
    pointers.sort_by(|a, b| {
        depth(b)
            .cmp(&depth(a))
            .then_with(|| last_index(b).cmp(&last_index(a)))
    });
    for pointer in pointers {
        remove_pointer(&mut value, pointer)?;
    }
    canonical(&value)
}

fn canonical(value: &Value) -> Result<String, FingerprintError> {
    if !holds_inexact_integer(value) {
        return jcs(value);
    }
    let mut out = String::new();
    write_exact(value, &mut out)?;
    Ok(out)
}

fn jcs(value: &Value) -> Result<String, FingerprintError> {
    serde_json_canonicalizer::to_string(value)
        .map_err(|error| FingerprintError::Canonicalization(error.to_string()))
}

/// Largest integer a double holds exactly, with every integer below it.
const EXACT_IN_A_DOUBLE: u64 = 1 << 53;

/// Whether `value` holds an integer that JCS, writing it as a double, could
/// confuse with another.
fn holds_inexact_integer(value: &Value) -> bool {
    match value {
        Value::Number(number) => {
            number.as_u64().is_some_and(|n| n > EXACT_IN_A_DOUBLE)
                || number
                    .as_i64()
                    .is_some_and(|n| n.unsigned_abs() > EXACT_IN_A_DOUBLE)
        }
        Value::Array(items) => items.iter().any(holds_inexact_integer),
        Value::Object(object) => object.values().any(holds_inexact_integer),
        Value::Null | Value::Bool(_) | Value::String(_) => false,
    }
}

/// JCS, but integers written exactly: keys sorted by UTF-16 code units as
/// JCS sorts them, every other leaf as JCS writes it.
fn write_exact(value: &Value, out: &mut String) -> Result<(), FingerprintError> {
    match value {
        Value::Object(object) => {
            let mut entries: Vec<(&String, &Value)> = object.iter().collect();
            entries.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&jcs(&Value::String(key.clone()))?);
                out.push(':');
                write_exact(item, out)?;
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_exact(item, out)?;
            }
            out.push(']');
        }
        Value::Number(number) if number.is_u64() || number.is_i64() => {
            out.push_str(&number.to_string());
        }
        leaf => out.push_str(&jcs(leaf)?),
    }
    Ok(())
}

fn depth(pointer: &str) -> usize {
    pointer.matches('/').count()
}

/// The last token of `pointer` as an array index, when it is one.
fn last_index(pointer: &str) -> Option<usize> {
    pointer.rsplit('/').next()?.parse().ok()
}

/// Whether `pointer` is a JSON Pointer (RFC 6901): empty, or starting with `/`.
pub(crate) fn is_pointer(pointer: &str) -> bool {
    pointer.is_empty() || pointer.starts_with('/')
}

/// Removes what `pointer` names; a pointer to nothing removes nothing (the
/// field is optional). The empty pointer names the whole document: it is
/// replaced by `null`.
fn remove_pointer(value: &mut Value, pointer: &str) -> Result<(), FingerprintError> {
    if pointer.is_empty() {
        *value = Value::Null;
        return Ok(());
    }
    let Some(split) = pointer.rfind('/').filter(|_| is_pointer(pointer)) else {
        return Err(FingerprintError::InvalidPointer(pointer.to_owned()));
    };
    let (parent, last) = (&pointer[..split], &pointer[split + 1..]);
    let token = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(Value::Object(object)) => {
            object.remove(&token);
        }
        Some(Value::Array(array)) => {
            if let Ok(index) = token.parse::<usize>()
                && index < array.len()
            {
                array.remove(index);
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact writer departs from JCS only in big integers.
    #[test]
    fn the_exact_writer_agrees_with_jcs_below_big_integers() {
        for text in [
            r#"{"numbers":[333333333.33333329,1E30,4.50,2e-3,1e-27,-0.0,12],"literals":[null,true,false]}"#,
            r#"{"\u20ac":1,"\r":2,"\ufb33":3,"1":4,"\ud83d\ude00":5,"\u0080":6,"\u00f6":7}"#,
            r#"{"string":"\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/","nested":{"b":[],"a":{}}}"#,
            r#"[-9007199254740992, 9007199254740992, 0, -1]"#,
        ] {
            let value: Value = serde_json::from_str(text).unwrap();
            let mut exact = String::new();
            write_exact(&value, &mut exact).unwrap();
            assert_eq!(exact, jcs(&value).unwrap(), "{text}");
        }
    }
}
