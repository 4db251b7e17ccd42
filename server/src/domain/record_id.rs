use super::InvalidField;

/// The scope of an idempotency key: (namespace, operation, subject, key).
/// Only [`RecordId::parse`] builds one, so every value held is valid.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordId {
    namespace: String,
    operation: String,
    subject: String,
    key: String,
}

const NAMESPACE_MAX: usize = 63;
const OPERATION_MAX: usize = 128;
const SUBJECT_MAX_BYTES: usize = 256;
const KEY_MIN: usize = 8;
const KEY_MAX: usize = 128;

impl RecordId {
    /// Validates the four parts. `prefix` is the path of the id in the
    /// request (e.g. `id`), so errors name the field as the caller sent it.
    pub fn parse(
        prefix: &str,
        namespace: String,
        operation: String,
        subject: String,
        key: String,
    ) -> Result<Self, InvalidField> {
        let field = |name: &str| format!("{prefix}.{name}");
        check_namespace(&namespace).map_err(|d| InvalidField::new(field("namespace"), d))?;
        check_operation(&operation).map_err(|d| InvalidField::new(field("operation"), d))?;
        check_subject(&subject).map_err(|d| InvalidField::new(field("subject"), d))?;
        check_key(&key).map_err(|d| InvalidField::new(field("key"), d))?;
        Ok(Self {
            namespace,
            operation,
            subject,
            key,
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn operation(&self) -> &str {
        &self.operation
    }
    pub fn subject(&self) -> &str {
        &self.subject
    }
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// Records of one namespace, narrowed by any of the other three parts of
/// their id: what an operator's purge deletes. Only [`RecordFilter::parse`]
/// builds one; each part given is valid as in a [`RecordId`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordFilter {
    namespace: String,
    operation: Option<String>,
    subject: Option<String>,
    key: Option<String>,
}

impl RecordFilter {
    /// Validates the parts given; `prefix` names the fields in errors.
    pub fn parse(
        prefix: &str,
        namespace: String,
        operation: Option<String>,
        subject: Option<String>,
        key: Option<String>,
    ) -> Result<Self, InvalidField> {
        let field = |name: &str| format!("{prefix}.{name}");
        check_namespace(&namespace).map_err(|d| InvalidField::new(field("namespace"), d))?;
        let check = |name: &str, value: &Option<String>, check: fn(&str) -> Result<(), String>| {
            value
                .as_deref()
                .map_or(Ok(()), check)
                .map_err(|d| InvalidField::new(field(name), d))
        };
        check("operation", &operation, check_operation)?;
        check("subject", &subject, check_subject)?;
        check("key", &key, check_key)?;
        Ok(Self {
            namespace,
            operation,
            subject,
            key,
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn operation(&self) -> Option<&str> {
        self.operation.as_deref()
    }
    pub fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }
}

fn check_namespace(value: &str) -> Result<(), String> {
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > NAMESPACE_MAX {
        return Err(format!(
            "must be 1-{NAMESPACE_MAX} characters, got {}",
            value.chars().count()
        ));
    }
    let head_ok = bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit();
    let tail_ok = bytes[1..]
        .iter()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if !(head_ok && tail_ok) {
        return Err("must match [a-z0-9][a-z0-9._-]*".into());
    }
    Ok(())
}

fn check_operation(value: &str) -> Result<(), String> {
    let len = value.chars().count();
    if len == 0 || len > OPERATION_MAX {
        return Err(format!("must be 1-{OPERATION_MAX} characters, got {len}"));
    }
    if !value.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err("must be printable ASCII (0x20-0x7E)".into());
    }
    Ok(())
}

fn check_subject(value: &str) -> Result<(), String> {
    if value.len() > SUBJECT_MAX_BYTES {
        return Err(format!(
            "must be at most {SUBJECT_MAX_BYTES} bytes of UTF-8, got {}",
            value.len()
        ));
    }
    // Postgres text cannot hold NUL; refusing it here keeps it a client error.
    if value.contains('\0') {
        return Err("must not contain NUL".into());
    }
    Ok(())
}

fn check_key(value: &str) -> Result<(), String> {
    let len = value.chars().count();
    if !(KEY_MIN..=KEY_MAX).contains(&len) {
        return Err(format!("must be {KEY_MIN}-{KEY_MAX} characters, got {len}"));
    }
    if !value.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err("must be printable ASCII without space (0x21-0x7E)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(
        namespace: &str,
        operation: &str,
        subject: &str,
        key: &str,
    ) -> Result<RecordId, InvalidField> {
        RecordId::parse(
            "id",
            namespace.into(),
            operation.into(),
            subject.into(),
            key.into(),
        )
    }

    fn field_of(result: Result<RecordId, InvalidField>) -> String {
        result.expect_err("should be invalid").field
    }

    #[test]
    fn accepts_the_documented_shapes() {
        assert!(id("payments", "POST /payments", "", "abcdefgh").is_ok());
        assert!(id("a", "x", &"é".repeat(128), &"k".repeat(128)).is_ok());
        assert!(id(&"a".repeat(63), &"o".repeat(128), "user-1", "!~#$%&'()").is_ok());
        assert!(id("billing.v2_x-y", "op", "user", "0123456789").is_ok());
    }

    #[test]
    fn key_length_bounds_are_inclusive() {
        assert_eq!(field_of(id("ns", "op", "", &"k".repeat(7))), "id.key");
        assert!(id("ns", "op", "", &"k".repeat(8)).is_ok());
        assert!(id("ns", "op", "", &"k".repeat(128)).is_ok());
        assert_eq!(field_of(id("ns", "op", "", &"k".repeat(129))), "id.key");
    }

    #[test]
    fn key_rejects_space_control_and_non_ascii() {
        for key in [
            "abcd efgh",
            "abcd\tefgh",
            "abcdefgh\u{7f}",
            "abcdéfgh",
            "abcd\0efgh",
        ] {
            assert_eq!(field_of(id("ns", "op", "", key)), "id.key", "{key:?}");
        }
    }

    #[test]
    fn each_part_is_named_when_invalid() {
        assert_eq!(field_of(id("", "op", "", "abcdefgh")), "id.namespace");
        assert_eq!(
            field_of(id("Payments", "op", "", "abcdefgh")),
            "id.namespace"
        );
        assert_eq!(field_of(id("-ns", "op", "", "abcdefgh")), "id.namespace");
        assert_eq!(
            field_of(id(&"a".repeat(64), "op", "", "abcdefgh")),
            "id.namespace"
        );
        assert_eq!(field_of(id("ns", "", "", "abcdefgh")), "id.operation");
        assert_eq!(field_of(id("ns", "op\n", "", "abcdefgh")), "id.operation");
        assert_eq!(
            field_of(id("ns", &"o".repeat(129), "", "abcdefgh")),
            "id.operation"
        );
        assert_eq!(
            field_of(id("ns", "op", &"s".repeat(257), "abcdefgh")),
            "id.subject"
        );
        assert_eq!(field_of(id("ns", "op", "a\0b", "abcdefgh")), "id.subject");
    }

    #[test]
    fn a_filter_needs_a_valid_namespace_and_checks_each_part_given() {
        let filter = |operation: Option<&str>, subject: Option<&str>, key: Option<&str>| {
            RecordFilter::parse(
                "purge",
                "payments".into(),
                operation.map(Into::into),
                subject.map(Into::into),
                key.map(Into::into),
            )
        };
        let all = filter(None, None, None).unwrap();
        assert_eq!(
            (all.namespace(), all.operation(), all.subject(), all.key()),
            ("payments", None, None, None)
        );
        assert!(filter(Some("POST /x"), Some(""), Some("abcdefgh")).is_ok());
        let field = |result: Result<RecordFilter, InvalidField>| result.unwrap_err().field;
        assert_eq!(field(filter(Some(""), None, None)), "purge.operation");
        assert_eq!(field(filter(None, Some("a\0b"), None)), "purge.subject");
        assert_eq!(field(filter(None, None, Some("short"))), "purge.key");
        let namespace = RecordFilter::parse("purge", "Payments".into(), None, None, None);
        assert_eq!(field(namespace), "purge.namespace");
    }
}
