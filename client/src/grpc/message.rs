//! The request message: which methods are covered, reading the one message
//! of a unary call, and its canonical fingerprint.

use std::collections::HashMap;

use bytes::Bytes;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};

use crate::fingerprint;

/// The unary methods of a descriptor pool, by full name (`/pkg.Service/Method`),
/// with their request message types. Streaming methods are left out: they
/// pass through the layer.
#[derive(Debug, Clone)]
pub(crate) struct Methods(HashMap<String, MessageDescriptor>);

impl Methods {
    pub(crate) fn unary_of(pool: &DescriptorPool) -> Self {
        let methods = pool
            .services()
            .flat_map(|service| service.methods().collect::<Vec<_>>())
            .filter(|method| !method.is_client_streaming() && !method.is_server_streaming())
            .map(|method| {
                let name = format!("/{}/{}", method.parent_service().full_name(), method.name());
                (name, method.input())
            })
            .collect();
        Self(methods)
    }

    /// The request type of the unary method at `path`, if it is one.
    pub(crate) fn input_of(&self, path: &str) -> Option<&MessageDescriptor> {
        self.0.get(path)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// Why a request body is not one readable message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unreadable {
    /// The message is compressed (`grpc-encoding`): the layer does not inflate it.
    Compressed,
    /// Not exactly one length-prefixed message.
    Framing,
    /// The message does not decode as the method's request type.
    Decode(String),
}

/// The message of a unary request body: one frame of a zero flag byte
/// (uncompressed), a 4-byte big-endian length, and that many bytes.
pub(crate) fn unframe(body: &Bytes) -> Result<Bytes, Unreadable> {
    let Some((&flag, rest)) = body.split_first() else {
        return Err(Unreadable::Framing);
    };
    let Some((length, _)) = rest.split_first_chunk::<4>() else {
        return Err(Unreadable::Framing);
    };
    if flag == 1 {
        return Err(Unreadable::Compressed);
    }
    let length = u32::from_be_bytes(*length) as usize;
    if flag != 0 || body.len() != 5 + length {
        return Err(Unreadable::Framing);
    }
    Ok(body.slice(5..))
}

/// The fingerprint of `message`, a `input`: SHA-256 of the RFC 8785 form
/// ([`fingerprint::json`]) of its proto3 JSON mapping, without the
/// `excluded` JSON pointers. See the module docs of [`super`] for the rule.
pub(crate) fn fingerprint(
    input: &MessageDescriptor,
    message: Bytes,
    excluded: &[String],
) -> Result<Vec<u8>, Unreadable> {
    let message = DynamicMessage::decode(input.clone(), message)
        .map_err(|error| Unreadable::Decode(error.to_string()))?;
    // Default options: the standard proto3 JSON mapping (json_name keys,
    // defaults omitted, 64-bit integers as strings, enums by name).
    let json = serde_json::to_value(&message).map_err(|error| Unreadable::Decode(error.to_string()))?;
    let excluded: Vec<&str> = excluded.iter().map(String::as_str).collect();
    fingerprint::json(&json, &excluded).map_err(|error| Unreadable::Decode(error.to_string()))
}
