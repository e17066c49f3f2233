//! What an expression's output may be, whichever evaluator made it.

/// The largest JSON text an expression may produce for one event.
pub const MAX_OUTPUT_BYTES: usize = 1 << 20;
/// The deepest nesting an expression's JSON output may have.
pub const MAX_DEPTH: usize = 128;
