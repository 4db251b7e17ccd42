//! Who may touch which namespace: the policy file, and the one decision
//! every call and every batch item goes through.
//!
//! ```toml
//! [[grant]]
//! principals = ["spiffe://cluster.local/ns/payments/sa/*"]  # exact, or * and ? globs
//! namespaces = ["payments", "payments-*"]
//! role = "caller"                                           # reader | caller | admin
//! ```
//!
//! Anything no grant allows is denied. Grants only add: there is no deny rule
//! to order against them.

use serde::Deserialize;
use toml::Spanned;
use wildmatch::WildMatch;

use super::watch::{line_of, toml_error};

/// What a grant lets its principals do on its namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// `Get` only.
    Reader,
    /// Every call of the API.
    Caller,
    /// Everything, including what only operators may do.
    Admin,
}

/// What a call does to a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `Get`.
    Read,
    /// `Acquire`, `Complete`, `Fail`, `Renew` and the batch items.
    Write,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
        }
    }
}

impl Role {
    fn permits(self, access: Access) -> bool {
        match self {
            Role::Reader => access == Access::Read,
            Role::Caller | Role::Admin => true,
        }
    }
}

#[derive(Debug)]
struct Grant {
    principals: Vec<WildMatch>,
    namespaces: Vec<WildMatch>,
    role: Role,
}

/// The parsed policy file.
#[derive(Debug, Default)]
pub struct Policy {
    grants: Vec<Grant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    grant: Vec<Spanned<GrantEntry>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantEntry {
    principals: Spanned<Vec<Spanned<String>>>,
    namespaces: Spanned<Vec<Spanned<String>>>,
    role: Role,
}

fn patterns(
    text: &str,
    field: &str,
    list: Spanned<Vec<Spanned<String>>>,
) -> Result<Vec<WildMatch>, String> {
    let span = list.span();
    let list = list.into_inner();
    if list.is_empty() {
        return Err(format!(
            "line {}: {field} is empty: a grant names at least one",
            line_of(text, span.start)
        ));
    }
    list.into_iter()
        .map(|pattern| {
            let line = line_of(text, pattern.span().start);
            let pattern = pattern.into_inner();
            if pattern.trim().is_empty() {
                return Err(format!("line {line}: {field} holds an empty pattern"));
            }
            if pattern != pattern.trim() {
                return Err(format!(
                    "line {line}: {field} pattern {pattern:?} has leading or trailing spaces"
                ));
            }
            Ok(WildMatch::new(&pattern))
        })
        .collect()
}

impl Policy {
    /// Parses a policy file; errors name the line.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: PolicyFile = toml::from_str(text).map_err(|error| toml_error(text, &error))?;
        let grants = file
            .grant
            .into_iter()
            .map(|entry| {
                let entry = entry.into_inner();
                Ok(Grant {
                    principals: patterns(text, "principals", entry.principals)?,
                    namespaces: patterns(text, "namespaces", entry.namespaces)?,
                    role: entry.role,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self { grants })
    }

    /// Grants in the file.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }

    /// May `principal` do `access` on records of `namespace`?
    pub fn allows(&self, principal: &str, namespace: &str, access: Access) -> bool {
        self.grants.iter().any(|grant| {
            grant.role.permits(access)
                && grant.principals.iter().any(|p| p.matches(principal))
                && grant.namespaces.iter().any(|n| n.matches(namespace))
        })
    }

    /// Does any grant name `principal`? Reflection answers those callers.
    pub fn names(&self, principal: &str) -> bool {
        self.grants
            .iter()
            .any(|grant| grant.principals.iter().any(|p| p.matches(principal)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = r#"
# payments' pods, by SPIFFE id or service account
[[grant]]
principals = ["spiffe://cluster.local/ns/payments/sa/*", "system:serviceaccount:payments:api"]
namespaces = ["payments", "payments-*"]
role = "caller"

[[grant]]
principals = ["support-tool"]
namespaces = ["*"]
role = "reader"

[[grant]]
principals = ["ops"]
namespaces = ["refunds"]
role = "admin"
"#;

    #[test]
    fn grants_allow_their_principals_their_namespaces_and_nothing_else() {
        let policy = Policy::parse(POLICY).unwrap();
        assert_eq!(policy.len(), 3);
        let api = "spiffe://cluster.local/ns/payments/sa/api";
        let cases = [
            (api, "payments", Access::Write, true),
            (api, "payments", Access::Read, true),
            (api, "payments-eu", Access::Write, true),
            (api, "refunds", Access::Read, false),
            (api, "paymentsx", Access::Write, false),
            (
                "spiffe://cluster.local/ns/refunds/sa/api",
                "payments",
                Access::Read,
                false,
            ),
            (
                "system:serviceaccount:payments:api",
                "payments",
                Access::Write,
                true,
            ),
            (
                "system:serviceaccount:payments:api2",
                "payments",
                Access::Write,
                false,
            ),
            ("support-tool", "refunds", Access::Read, true),
            ("support-tool", "refunds", Access::Write, false),
            ("ops", "refunds", Access::Write, true),
            ("ops", "payments", Access::Read, false),
            ("", "payments", Access::Read, false),
            ("SUPPORT-TOOL", "refunds", Access::Read, false),
        ];
        for (principal, namespace, access, allowed) in cases {
            assert_eq!(
                policy.allows(principal, namespace, access),
                allowed,
                "{principal} {namespace} {access:?}"
            );
        }
        assert!(policy.names(api));
        assert!(!policy.names("stranger"));
    }

    #[test]
    fn an_empty_policy_denies_everything() {
        let policy = Policy::parse("").unwrap();
        assert!(policy.is_empty());
        assert!(!policy.allows("anyone", "payments", Access::Read));
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            (
                "[[grant]]\nprincipals = [\"a\"]\nnamespaces = [\"b\"]\nrole = \"owner\"\n",
                "line 4",
            ),
            (
                "[[grant]]\nprincipals = []\nnamespaces = [\"b\"]\nrole = \"caller\"\n",
                "line 2",
            ),
            (
                "[[grant]]\nprincipals = [\"a\"]\nnamespaces = [\"b\", \"\"]\nrole = \"caller\"\n",
                "line 3",
            ),
            (
                "[[grant]]\nprincipal = [\"a\"]\nnamespaces = [\"b\"]\nrole = \"caller\"\n",
                "line 2",
            ),
            ("[[grant]]\nprincipals = [\"a\"\n", "line 2"),
            (
                "[[grant]]\nnamespaces = [\"b\"]\nrole = \"caller\"\n",
                "principals",
            ),
        ];
        for (text, expected) in cases {
            let error = Policy::parse(text).unwrap_err();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }
}
