//! The inbox: which events a consumer has already applied.

use crate::Error;

/// What recording an event in the inbox found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "apply the business effect only for InboxOutcome::New"]
pub enum InboxOutcome {
    /// First time this consumer sees the event: apply its effect in the same transaction.
    New,
    /// Already recorded by this consumer: skip the effect, acknowledge the delivery.
    Duplicate,
}

impl InboxOutcome {
    pub(crate) fn from_rows(rows: u64) -> Self {
        if rows == 1 {
            InboxOutcome::New
        } else {
            InboxOutcome::Duplicate
        }
    }

    /// True for [`InboxOutcome::New`].
    pub fn is_new(self) -> bool {
        self == InboxOutcome::New
    }
}

pub(crate) fn check_consumer(consumer: &str) -> Result<(), Error> {
    let reason = if consumer.is_empty() {
        "it is empty"
    } else if consumer.len() > crate::MAX_NAME_BYTES {
        "it is longer than 255 bytes"
    } else if consumer.contains('\0') {
        "it contains a NUL character"
    } else {
        return Ok(());
    };
    Err(Error::InvalidConsumer {
        reason: reason.to_owned(),
    })
}
