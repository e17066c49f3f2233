//! The test kit's own tests.

mod cleanup;
