//! The HTTP side of the console.

pub(crate) mod guard;
