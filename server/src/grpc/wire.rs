//! Counts fields of an encoded protobuf message without decoding it, so that
//! a batch of two million empty items, or a response with a hundred thousand
//! headers, is refused before any of them is allocated. Decoding would build
//! a struct of ~150 bytes for each 2-byte empty item.

use prost::{
    bytes::Buf,
    encoding::{DecodeContext, WireType, decode_key, decode_varint, skip_field},
};

/// The bytes are not a protobuf message: the decoder would refuse them too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a valid protobuf message")]
pub struct Malformed;

/// How many times the field at `path` occurs: `[1]` counts field 1 of the
/// message, `[1, 3, 3]` counts field 3 inside field 3 inside every field 1
/// (summed over all of them). Inner steps must be message fields; an inner
/// occurrence that is not length-delimited holds nothing to count (the
/// decoder refuses it anyway).
pub fn count(message: &[u8], path: &[u32]) -> Result<usize, Malformed> {
    let Some((&number, inner)) = path.split_first() else {
        return Ok(0);
    };
    let mut total = 0usize;
    let mut rest = message;
    while rest.has_remaining() {
        let (tag, wire_type) = decode_key(&mut rest).map_err(|_| Malformed)?;
        if wire_type != WireType::LengthDelimited {
            skip_field(wire_type, tag, &mut rest, DecodeContext::default())
                .map_err(|_| Malformed)?;
            if tag == number && inner.is_empty() {
                total += 1;
            }
            continue;
        }
        let len = decode_varint(&mut rest).map_err(|_| Malformed)?;
        let len = usize::try_from(len).map_err(|_| Malformed)?;
        if len > rest.len() {
            return Err(Malformed);
        }
        let (field, after) = rest.split_at(len);
        rest = after;
        if tag == number {
            total += if inner.is_empty() {
                1
            } else {
                count(field, inner)?
            };
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::grpc::pb;

    fn complete(headers: usize) -> pb::CompleteRequest {
        pb::CompleteRequest {
            id: Some(pb::RecordId {
                namespace: "ns".into(),
                key: "key-0001".into(),
                ..Default::default()
            }),
            fencing_token: 7,
            response: Some(pb::StoredResponse {
                status_code: 200,
                body: b"{}".to_vec(),
                headers: (0..headers)
                    .map(|i| (format!("h{i}"), "v".into()))
                    .collect(),
            }),
        }
    }

    #[test]
    fn counts_top_level_items_even_empty_ones() {
        let batch = pb::BatchAcquireRequest {
            requests: vec![pb::AcquireRequest::default(); 1000],
        };
        let bytes = batch.encode_to_vec();
        // Empty items are two bytes each: tag and zero length.
        assert_eq!(bytes.len(), 2000);
        assert_eq!(count(&bytes, &[1]), Ok(1000));
        assert_eq!(count(&[], &[1]), Ok(0));
    }

    #[test]
    fn counts_nested_fields_across_every_item() {
        let batch = pb::BatchCompleteRequest {
            requests: vec![complete(3), complete(0), complete(5)],
        };
        let bytes = batch.encode_to_vec();
        assert_eq!(count(&bytes, &[1]), Ok(3));
        assert_eq!(count(&bytes, &[1, 3, 3]), Ok(8));
        assert_eq!(count(&complete(4).encode_to_vec(), &[3, 3]), Ok(4));
    }

    #[test]
    fn a_repeated_message_field_counts_every_occurrence_as_the_decoder_merges_them() {
        // Field 3 (response) sent twice: the decoder merges both header maps.
        let mut bytes = complete(2).encode_to_vec();
        bytes.extend(complete(3).encode_to_vec());
        assert_eq!(count(&bytes, &[3, 3]), Ok(5));
        let decoded = pb::CompleteRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded.response.unwrap().headers.len(), 3); // same names h0..h2
    }

    #[test]
    fn unknown_fields_of_every_wire_type_are_skipped() {
        let mut bytes = Vec::new();
        prost::encoding::uint64::encode(9, &5, &mut bytes);
        prost::encoding::fixed32::encode(10, &5, &mut bytes);
        prost::encoding::fixed64::encode(11, &5, &mut bytes);
        // A group (field 12) holding a varint.
        prost::encoding::encode_key(12, WireType::StartGroup, &mut bytes);
        prost::encoding::uint64::encode(1, &1, &mut bytes);
        prost::encoding::encode_key(12, WireType::EndGroup, &mut bytes);
        bytes.extend(
            pb::BatchAcquireRequest {
                requests: vec![pb::AcquireRequest::default(); 3],
            }
            .encode_to_vec(),
        );
        assert_eq!(count(&bytes, &[1]), Ok(3));
        assert!(pb::BatchAcquireRequest::decode(bytes.as_slice()).is_ok());
    }

    #[test]
    fn truncated_or_invalid_bytes_are_malformed() {
        let bytes = pb::BatchAcquireRequest {
            requests: vec![pb::AcquireRequest::default(); 3],
        }
        .encode_to_vec();
        // A length running past the end.
        assert_eq!(count(&[0x0a, 0x05, 0x00], &[1]), Err(Malformed));
        // Field number 0.
        assert_eq!(count(&[0x02, 0x00], &[1]), Err(Malformed));
        // An end-group with no start.
        assert_eq!(count(&[0x0c], &[1]), Err(Malformed));
        assert_eq!(count(&bytes[..bytes.len() - 1], &[1]), Err(Malformed));
    }
}
