//! `stdout`: one CloudEvents JSON line per event, for development and piping.
//! Always built; it takes no URL parameters and has no options table, so it
//! has no `config.rs`.

use crate::{BuiltSink, SinkOptions};
use async_trait::async_trait;
use postbox_sink::cloudevents;
use postbox_sink::{Message, Outcome, Sink, SinkError};
use std::io::Write;
use std::sync::Arc;

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "stdout  one CloudEvents JSON line per event (development, piping)",
    build: |_, options| Ok(Arc::new(StdoutSink::new(options.clone()))),
};

/// The stdout sink; see the module docs.
pub struct StdoutSink {
    options: SinkOptions,
}

impl StdoutSink {
    pub fn new(options: SinkOptions) -> Self {
        Self { options }
    }
}

#[async_trait]
impl Sink for StdoutSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut text = String::new();
        for m in batch {
            text.push_str(&cloudevents::to_json(m, &self.options.source));
            text.push('\n');
        }
        // A development sink: a short blocking write is acceptable here.
        let mut out = std::io::stdout().lock();
        let written = out.write_all(text.as_bytes()).and_then(|()| out.flush());
        match written {
            Ok(()) => vec![Outcome::Delivered; batch.len()],
            Err(e) => vec![Outcome::retry(format!("writing to stdout failed: {e}")); batch.len()],
        }
    }

    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "stdout".to_owned()
    }
}
