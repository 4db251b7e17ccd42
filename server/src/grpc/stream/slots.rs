//! How many streams may be open: on the server, on one connection, and
//! for one principal (with auth on).

use std::{
    collections::HashMap,
    hash::Hash,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use metrics::Gauge;
use tonic::{Code, Status};

use super::super::status::{reason, with_reason};
use crate::metrics::GRPC_STREAMS_OPEN;

/// The limits on open streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLimits {
    pub max_streams: usize,
    pub per_connection: usize,
    pub per_principal: usize,
}

/// The streams open now, against [`SlotLimits`].
#[derive(Debug)]
pub(super) struct Slots {
    limits: SlotLimits,
    open: Mutex<Open>,
    gauge: Gauge,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_connection: HashMap<SocketAddr, usize>,
    by_principal: HashMap<Arc<str>, usize>,
}

/// Why a stream was not opened, as a metric label and the caller's status.
#[derive(Debug)]
pub(super) struct Refused {
    pub reason: &'static str,
    pub status: Status,
}

impl Slots {
    pub(super) fn new(limits: SlotLimits) -> Arc<Self> {
        let gauge = metrics::gauge!(GRPC_STREAMS_OPEN);
        gauge.increment(0.0);
        Arc::new(Self {
            limits,
            open: Mutex::new(Open::default()),
            gauge,
        })
    }

    /// A slot for a stream of `connection` (the peer's address) and
    /// `principal`, held until dropped.
    pub(super) fn open(
        self: &Arc<Self>,
        connection: Option<SocketAddr>,
        principal: Option<Arc<str>>,
    ) -> Result<Slot, Refused> {
        let limits = self.limits;
        let mut open = self.open.lock().expect("no panics while held");
        if open.total >= limits.max_streams {
            return Err(Refused {
                reason: "overloaded",
                status: with_reason(
                    Code::Unavailable,
                    format!(
                        "the server has {} streams open, its limit (--max-streams); retry with \
                         backoff, or send unary batch calls",
                        limits.max_streams
                    ),
                    reason::OVERLOADED,
                ),
            });
        }
        let connection_full = connection.is_some_and(|c| {
            open.by_connection.get(&c).copied().unwrap_or(0) >= limits.per_connection
        });
        let principal_full = principal.as_ref().is_some_and(|p| {
            open.by_principal.get(p).copied().unwrap_or(0) >= limits.per_principal
        });
        if connection_full || principal_full {
            let (whose, limit, flag) = if connection_full {
                (
                    "this connection",
                    limits.per_connection,
                    "--stream-max-per-connection",
                )
            } else {
                (
                    "this principal",
                    limits.per_principal,
                    "--stream-max-per-principal",
                )
            };
            return Err(Refused {
                reason: "too_many_streams",
                status: with_reason(
                    Code::ResourceExhausted,
                    format!("{whose} has {limit} streams open, its limit ({flag})"),
                    reason::TOO_MANY_STREAMS,
                ),
            });
        }
        open.total += 1;
        if let Some(connection) = connection {
            *open.by_connection.entry(connection).or_default() += 1;
        }
        if let Some(principal) = &principal {
            *open.by_principal.entry(principal.clone()).or_default() += 1;
        }
        self.gauge.increment(1.0);
        Ok(Slot {
            slots: self.clone(),
            connection,
            principal,
        })
    }
}

/// An open stream's place, given back when the stream ends.
#[derive(Debug)]
pub(super) struct Slot {
    slots: Arc<Slots>,
    connection: Option<SocketAddr>,
    principal: Option<Arc<str>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.slots.open.lock().expect("no panics while held");
        open.total -= 1;
        if let Some(connection) = self.connection {
            release(&mut open.by_connection, &connection);
        }
        if let Some(principal) = &self.principal {
            release(&mut open.by_principal, principal);
        }
        self.slots.gauge.decrement(1.0);
    }
}

/// One fewer for `key`, forgotten at none, so that the maps hold only the
/// keys with streams open.
fn release<K: Eq + Hash>(counts: &mut HashMap<K, usize>, key: &K) {
    if let Some(count) = counts.get_mut(key) {
        *count -= 1;
        if *count == 0 {
            counts.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> Option<SocketAddr> {
        Some(SocketAddr::from(([127, 0, 0, 1], port)))
    }

    #[test]
    fn each_limit_refuses_the_next_stream_until_one_ends() {
        let slots = Slots::new(SlotLimits {
            max_streams: 4,
            per_connection: 2,
            per_principal: 3,
        });
        let alice: Option<Arc<str>> = Some("alice".into());
        let a = slots.open(addr(1), alice.clone()).unwrap();
        let _b = slots.open(addr(1), alice.clone()).unwrap();
        let refused = slots.open(addr(1), None).unwrap_err();
        assert_eq!(refused.reason, "too_many_streams");
        assert_eq!(refused.status.code(), Code::ResourceExhausted);
        let _c = slots.open(addr(2), alice.clone()).unwrap();
        let refused = slots.open(addr(3), alice.clone()).unwrap_err();
        assert!(
            refused.status.message().contains("principal"),
            "{}",
            refused.status.message()
        );
        let _d = slots.open(addr(3), Some("bob".into())).unwrap();
        let refused = slots.open(addr(4), Some("carol".into())).unwrap_err();
        assert_eq!(refused.reason, "overloaded");
        assert_eq!(refused.status.code(), Code::Unavailable);
        drop(a);
        let _e = slots.open(addr(1), Some("carol".into())).unwrap();
        assert_eq!(slots.open.lock().unwrap().by_connection.len(), 3);
    }

    #[test]
    fn ended_streams_leave_nothing_behind() {
        let slots = Slots::new(SlotLimits {
            max_streams: 10,
            per_connection: 10,
            per_principal: 10,
        });
        let held: Vec<_> = (0..5)
            .map(|port| {
                slots
                    .open(addr(port), Some(format!("p{port}").into()))
                    .unwrap()
            })
            .collect();
        drop(held);
        let open = slots.open.lock().unwrap();
        assert_eq!(open.total, 0);
        assert!(open.by_connection.is_empty() && open.by_principal.is_empty());
    }
}
