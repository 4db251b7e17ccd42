//! Issue 15's guarantees, end to end over real TLS against a real Postgres:
//! a caller touches only the namespaces the policy grants it, every bad
//! credential is UNAUTHENTICATED with nothing written, and certificates,
//! the policy, the JWKS and static tokens change without a restart.

mod client;
mod credentials;
mod modes;
mod namespaces;
mod rotation;
mod stream;
mod support;
