//! The events the shop publishes, typed and versioned.

use postbox::typed::{Decoder, Event};
use serde::{Deserialize, Serialize};

/// An order was placed. Version 1; an added optional field
/// (`#[serde(default)]`) keeps the version, any other change is a version 2.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlaced {
    pub order_id: i64,
    pub customer: String,
    pub items: Vec<String>,
    pub total_cents: i64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed";
    const VERSION: i32 = 1;
    fn aggregate(&self) -> (&str, String) {
        ("order", self.order_id.to_string())
    }
}

/// Every event the shop's consumer handles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShopEvent {
    OrderPlaced(OrderPlaced),
}

/// Decodes payloads by (event type, schema version).
pub fn decoder() -> Decoder<ShopEvent> {
    Decoder::new().register(ShopEvent::OrderPlaced)
}
