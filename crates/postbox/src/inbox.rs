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

/// Where a delivery stands in its aggregate's sequence, for one consumer.
///
/// Events carry their number within their aggregate (1, 2, …; the CloudEvents
/// extension `sequence`). [`check_sequence`](crate::sqlx::check_sequence) keeps,
/// per consumer and aggregate, the last number applied, and judges each delivery
/// against it inside the consumer's transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "apply the effect only for SequenceCheck::Apply"]
pub enum SequenceCheck {
    /// The next number: apply the effect in this transaction (the tracker has
    /// advanced, and rolls back with the transaction).
    Apply,
    /// At or below the last applied number: already applied, acknowledge and skip.
    Duplicate { last: i64 },
    /// Ahead of the next number: one or more earlier events have not been
    /// applied (still on their way, or skipped as poison upstream). Reject the
    /// delivery so it comes again, buffer it, or reconcile and call
    /// [`accept_gap`](crate::sqlx::accept_gap). The tracker did not move.
    Gap { expected: i64, got: i64 },
}

impl SequenceCheck {
    pub(crate) fn judge(last: i64, sequence: i64) -> Self {
        if sequence <= last {
            SequenceCheck::Duplicate { last }
        } else if sequence == last + 1 {
            SequenceCheck::Apply
        } else {
            SequenceCheck::Gap {
                expected: last + 1,
                got: sequence,
            }
        }
    }

    /// True for [`SequenceCheck::Apply`].
    pub fn is_apply(self) -> bool {
        self == SequenceCheck::Apply
    }
}

pub(crate) fn check_aggregate(
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    sequence: i64,
) -> Result<(), Error> {
    check_consumer(consumer)?;
    for (field, value) in [
        ("aggregate_type", aggregate_type),
        ("aggregate_id", aggregate_id),
    ] {
        if value.is_empty() || value.len() > crate::MAX_NAME_BYTES || value.contains('\0') {
            return Err(Error::InvalidEvent {
                field,
                reason: "must be 1 to 255 bytes long, without NUL characters".to_owned(),
            });
        }
    }
    if sequence < 1 {
        return Err(Error::InvalidEvent {
            field: "sequence",
            reason: format!("must be 1 or more, got {sequence}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod sequence_tests {
    use super::SequenceCheck;

    #[test]
    fn judges_next_duplicate_and_gap() {
        assert_eq!(SequenceCheck::judge(0, 1), SequenceCheck::Apply);
        assert_eq!(SequenceCheck::judge(4, 5), SequenceCheck::Apply);
        assert_eq!(
            SequenceCheck::judge(4, 4),
            SequenceCheck::Duplicate { last: 4 }
        );
        assert_eq!(
            SequenceCheck::judge(4, 2),
            SequenceCheck::Duplicate { last: 4 }
        );
        assert_eq!(
            SequenceCheck::judge(4, 7),
            SequenceCheck::Gap {
                expected: 5,
                got: 7
            }
        );
    }
}
