//! What the HTTP layer (`crate::http`) and the gRPC layer (`crate::grpc`)
//! share: reading the key, reading bodies with a bound, and the end of a
//! handler's run (store, release, or give up), so both keep one contract.

pub(crate) mod body;
pub(crate) mod key;
pub(crate) mod outcome;
