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
    let json =
        serde_json::to_value(&message).map_err(|error| Unreadable::Decode(error.to_string()))?;
    let excluded: Vec<&str> = excluded.iter().map(String::as_str).collect();
    fingerprint::json(&json, &excluded).map_err(|error| Unreadable::Decode(error.to_string()))
}

/// A descriptor set made by hand for the unit tests: package `t`, message
/// `Req { int64 amount = 1; map<string, string> meta = 2; repeated int32 ids = 3; }`,
/// service `S { rpc Do(Req) returns (Req); rpc Watch(Req) returns (stream Req); }`.
#[cfg(test)]
pub(crate) fn test_descriptor_set() -> Vec<u8> {
    use prost::Message;
    use prost_types::{
        DescriptorProto, FieldDescriptorProto, FileDescriptorProto, FileDescriptorSet,
        MessageOptions, MethodDescriptorProto, ServiceDescriptorProto,
        field_descriptor_proto::{Label, Type},
    };
    let field = |name: &str, number, label: Label, kind: Type, type_name: Option<&str>| {
        FieldDescriptorProto {
            name: Some(name.into()),
            number: Some(number),
            label: Some(label.into()),
            r#type: Some(kind.into()),
            type_name: type_name.map(Into::into),
            json_name: Some(name.into()),
            ..Default::default()
        }
    };
    let entry = DescriptorProto {
        name: Some("MetaEntry".into()),
        field: vec![
            field("key", 1, Label::Optional, Type::String, None),
            field("value", 2, Label::Optional, Type::String, None),
        ],
        options: Some(MessageOptions {
            map_entry: Some(true),
            ..Default::default()
        }),
        ..Default::default()
    };
    let request = DescriptorProto {
        name: Some("Req".into()),
        field: vec![
            field("amount", 1, Label::Optional, Type::Int64, None),
            field(
                "meta",
                2,
                Label::Repeated,
                Type::Message,
                Some(".t.Req.MetaEntry"),
            ),
            field("ids", 3, Label::Repeated, Type::Int32, None),
        ],
        nested_type: vec![entry],
        ..Default::default()
    };
    let method = |name: &str, streaming: bool| MethodDescriptorProto {
        name: Some(name.into()),
        input_type: Some(".t.Req".into()),
        output_type: Some(".t.Req".into()),
        server_streaming: Some(streaming),
        ..Default::default()
    };
    let file = FileDescriptorProto {
        name: Some("t.proto".into()),
        package: Some("t".into()),
        syntax: Some("proto3".into()),
        message_type: vec![request],
        service: vec![ServiceDescriptorProto {
            name: Some("S".into()),
            method: vec![method("Do", false), method("Watch", true)],
            ..Default::default()
        }],
        ..Default::default()
    };
    FileDescriptorSet { file: vec![file] }.encode_to_vec()
}

#[cfg(test)]
mod tests {
    use prost::encoding::{WireType, encode_key, encode_varint};

    use super::*;

    fn methods() -> Methods {
        Methods::unary_of(&DescriptorPool::decode(test_descriptor_set().as_slice()).unwrap())
    }

    fn varint(number: u32, value: u64, out: &mut Vec<u8>) {
        encode_key(number, WireType::Varint, out);
        encode_varint(value, out);
    }

    fn delimited(number: u32, bytes: &[u8], out: &mut Vec<u8>) {
        encode_key(number, WireType::LengthDelimited, out);
        encode_varint(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    }

    fn meta(key: &str, value: &str, out: &mut Vec<u8>) {
        let mut entry = Vec::new();
        delimited(1, key.as_bytes(), &mut entry);
        delimited(2, value.as_bytes(), &mut entry);
        delimited(2, &entry, out);
    }

    fn fingerprint_of(message: Vec<u8>, excluded: &[String]) -> Vec<u8> {
        let methods = methods();
        let input = methods.input_of("/t.S/Do").unwrap();
        fingerprint(input, message.into(), excluded).unwrap()
    }

    #[test]
    fn only_unary_methods_are_covered() {
        let methods = methods();
        assert_eq!(methods.input_of("/t.S/Do").unwrap().full_name(), "t.Req");
        assert!(methods.input_of("/t.S/Watch").is_none(), "server-streaming");
        assert!(methods.input_of("/t.S/Other").is_none());
    }

    #[test]
    fn the_fingerprint_is_the_canonical_proto3_json_of_the_message() {
        let mut message = Vec::new();
        varint(1, 5, &mut message);
        meta("b", "2", &mut message);
        meta("a", "1", &mut message);
        delimited(3, &[7, 8], &mut message);
        // {"amount":"5","ids":[7,8],"meta":{"a":"1","b":"2"}}: the rule spelled out.
        let canonical = r#"{"amount":"5","ids":[7,8],"meta":{"a":"1","b":"2"}}"#;
        let expected = crate::fingerprint::bytes(canonical.as_bytes());
        assert_eq!(fingerprint_of(message.clone(), &[]), expected);

        // Out of order, unpacked, map entries swapped, an unknown field.
        let mut rewritten = Vec::new();
        varint(3, 7, &mut rewritten);
        meta("a", "1", &mut rewritten);
        varint(99, 1, &mut rewritten);
        meta("b", "2", &mut rewritten);
        varint(3, 8, &mut rewritten);
        varint(1, 5, &mut rewritten);
        assert_eq!(fingerprint_of(rewritten, &[]), expected);

        // Another value differs; an excluded one does not.
        let mut other = message.clone();
        meta("a", "9", &mut other);
        assert_ne!(fingerprint_of(other.clone(), &[]), expected);
        assert_eq!(
            fingerprint_of(other, &["/meta/a".to_owned()]),
            fingerprint_of(message, &["/meta/a".to_owned()])
        );
    }

    #[test]
    fn a_body_must_be_one_uncompressed_message() {
        let framed = |flag: u8, length: u32, message: &[u8]| {
            let mut body = vec![flag];
            body.extend(length.to_be_bytes());
            body.extend(message);
            Bytes::from(body)
        };
        assert_eq!(
            unframe(&framed(0, 2, b"\x08\x05")).unwrap(),
            &b"\x08\x05"[..]
        );
        assert_eq!(unframe(&framed(0, 0, b"")).unwrap(), &b""[..]);
        assert_eq!(unframe(&framed(1, 2, b"xx")), Err(Unreadable::Compressed));
        for broken in [
            framed(0, 3, b"\x08\x05"),
            framed(0, 1, b"\x08\x05"),
            framed(2, 2, b"\x08\x05"),
            Bytes::from_static(b"\0\0\0"),
            Bytes::new(),
        ] {
            assert_eq!(unframe(&broken), Err(Unreadable::Framing), "{broken:?}");
        }
        let methods = methods();
        let input = methods.input_of("/t.S/Do").unwrap();
        assert!(matches!(
            fingerprint(input, Bytes::from_static(b"\x0a\x05"), &[]),
            Err(Unreadable::Decode(_))
        ));
    }
}
