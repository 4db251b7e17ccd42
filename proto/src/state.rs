use crate::pb;

/// Where a record is in its life.
///
/// Not `#[non_exhaustive]`: the service decides on every state with
/// exhaustive matches, so a new state cannot be added without each decision
/// being revisited; clients share this type and learn of one the same way
/// (a new state is a new release of this crate and of the proto).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordState {
    /// An attempt holds, or held, the lease.
    InProgress,
    /// Completed; the response is stored.
    Completed,
    /// Failed terminally; the error response is stored.
    Failed,
    /// Released by a retryable failure; the next Acquire takes it.
    Released,
}

impl RecordState {
    /// The state's name, `in_progress`, `completed`, `failed` or `released`:
    /// the spelling the service stores and names in its messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Released => "released",
        }
    }

    /// The state [`RecordState::as_str`] names; `None` for any other text.
    pub fn from_stored(value: &str) -> Option<Self> {
        Some(match value {
            "in_progress" => Self::InProgress,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            "released" => Self::Released,
            _ => return None,
        })
    }

    /// The state a message's `state` field holds; `None` for
    /// `RECORD_STATE_UNSPECIFIED` and for values this version does not know.
    pub fn from_pb(state: i32) -> Option<Self> {
        match pb::RecordState::try_from(state).ok()? {
            pb::RecordState::InProgress => Some(Self::InProgress),
            pb::RecordState::Completed => Some(Self::Completed),
            pb::RecordState::Failed => Some(Self::Failed),
            pb::RecordState::Released => Some(Self::Released),
            pb::RecordState::Unspecified => None,
        }
    }
}

impl From<RecordState> for pb::RecordState {
    fn from(state: RecordState) -> Self {
        match state {
            RecordState::InProgress => Self::InProgress,
            RecordState::Completed => Self::Completed,
            RecordState::Failed => Self::Failed,
            RecordState::Released => Self::Released,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [RecordState; 4] = [
        RecordState::InProgress,
        RecordState::Completed,
        RecordState::Failed,
        RecordState::Released,
    ];

    #[test]
    fn every_state_reads_back_from_its_name() {
        for state in ALL {
            assert_eq!(RecordState::from_stored(state.as_str()), Some(state));
        }
        assert_eq!(RecordState::from_stored("IN_PROGRESS"), None);
        assert_eq!(RecordState::from_stored(""), None);
    }

    #[test]
    fn every_state_reads_back_from_protobuf() {
        for state in ALL {
            assert_eq!(
                RecordState::from_pb(pb::RecordState::from(state) as i32),
                Some(state)
            );
        }
        assert_eq!(
            RecordState::from_pb(pb::RecordState::Unspecified as i32),
            None
        );
        assert_eq!(RecordState::from_pb(99), None);
    }
}
