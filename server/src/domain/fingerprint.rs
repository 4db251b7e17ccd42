use super::InvalidField;

/// Hash of the canonical request, at most 64 bytes. Empty means "do not check".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fingerprint(Vec<u8>);

const FINGERPRINT_MAX_BYTES: usize = 64;

impl Fingerprint {
    pub fn parse(field: &str, bytes: Vec<u8>) -> Result<Self, InvalidField> {
        if bytes.len() > FINGERPRINT_MAX_BYTES {
            return Err(InvalidField::new(
                field,
                format!(
                    "must be at most {FINGERPRINT_MAX_BYTES} bytes, got {}",
                    bytes.len()
                ),
            ));
        }
        Ok(Self(bytes))
    }

    /// Wraps bytes read back from the database, which only ever holds parsed values.
    pub(crate) fn from_stored(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// Two fingerprints conflict only when both were given and they differ.
    pub fn conflicts_with(&self, other: &Fingerprint) -> bool {
        !self.0.is_empty() && !other.0.is_empty() && self.0 != other.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_never_conflicts() {
        let empty = Fingerprint::default();
        let some = Fingerprint::parse("f", vec![1; 32]).unwrap();
        assert!(!empty.conflicts_with(&some));
        assert!(!some.conflicts_with(&empty));
        assert!(!some.conflicts_with(&some.clone()));
        assert!(some.conflicts_with(&Fingerprint::parse("f", vec![2; 32]).unwrap()));
    }

    #[test]
    fn longer_than_64_bytes_is_refused() {
        assert!(Fingerprint::parse("f", vec![0; 64]).is_ok());
        assert_eq!(Fingerprint::parse("f", vec![0; 65]).unwrap_err().field, "f");
    }
}
