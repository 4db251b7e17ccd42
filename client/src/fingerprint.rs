//! Request fingerprints: SHA-256 of the canonical request, so that a key
//! reused with a different request is caught (FINGERPRINT_MISMATCH, HTTP 422)
//! while the same request written differently is not.
//!
//! JSON is canonicalized per RFC 8785 (JCS): object keys sorted by UTF-16
//! code units, no insignificant whitespace, numbers in their shortest
//! ECMAScript form. Volatile fields (trace ids, client timestamps) are left
//! out by JSON Pointer (RFC 6901), e.g. `/meta/trace_id`.

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
    for pointer in excluded {
        remove_pointer(&mut value, pointer.as_ref())?;
    }
    canonical(&value)
}

fn canonical(value: &Value) -> Result<String, FingerprintError> {
    serde_json_canonicalizer::to_string(value)
        .map_err(|error| FingerprintError::Canonicalization(error.to_string()))
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
