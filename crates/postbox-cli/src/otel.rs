//! OpenTelemetry trace export over OTLP/HTTP (protobuf), configured by the
//! standard `OTEL_*` environment variables and off unless an endpoint is set.
//!
//! On when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, unless `OTEL_SDK_DISABLED=true` or
//! `OTEL_TRACES_EXPORTER=none`. The exporter and the SDK read the rest
//! themselves (`OTEL_EXPORTER_OTLP_HEADERS`, `…_TIMEOUT`, `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`). Off, no
//! exporter, thread or layer exists, and the spans of `postbox::otel` and
//! `postbox_relay::otel` are disabled at their callsites.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;

/// The targets of the spans exported (and kept out of the log).
pub const SPAN_TARGETS: [&str; 2] = ["postbox::otel", "postbox_relay::otel"];

/// What the environment asks for.
#[derive(Debug, PartialEq)]
pub enum Wanted {
    /// No endpoint set, or export switched off.
    Off,
    /// Export to this endpoint (the signal-specific one when both are set).
    Otlp {
        endpoint: String,
        /// `OTEL_EXPORTER_OTLP_PROTOCOL` asked for something other than
        /// `http/protobuf`, the only protocol built in.
        other_protocol: Option<String>,
    },
}

/// Read the decision from the environment (`var` looks a variable up).
pub fn wanted(var: impl Fn(&str) -> Option<String>) -> Wanted {
    let set = |name: &str| {
        var(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return Wanted::Off;
    }
    let Some(endpoint) =
        set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT"))
    else {
        return Wanted::Off;
    };
    let other_protocol = set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| set("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .filter(|p| p != "http/protobuf");
    Wanted::Otlp {
        endpoint,
        other_protocol,
    }
}

/// The running exporter: flush and stop it with [`Exporter::shutdown`].
pub struct Exporter {
    provider: SdkTracerProvider,
}

/// The exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the OpenTelemetry trace exporter: {0}")]
pub struct StartError(#[from] opentelemetry_otlp::ExporterBuildError);

impl Exporter {
    /// Build the OTLP/HTTP exporter (batching on its own thread) and the
    /// tracing layer feeding it. Call outside the async runtime.
    pub fn start<S>() -> Result<
        (
            Self,
            tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>,
        ),
        StartError,
    >
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        // The HTTPS client uses rustls with ring, like the sinks.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource(|name| std::env::var(name).ok()))
            .build();
        let layer = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("postbox"))
            .with_location(false)
            .with_threads(false);
        Ok((Self { provider }, layer))
    }

    /// Export what is still buffered and stop (bounded by the exporter's
    /// timeout). Errors are reported on stderr: the command's own result
    /// stands.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            postbox_harness::errln!("warning: flushing OpenTelemetry spans failed: {e}");
        }
    }
}

/// The process's resource: the SDK's (`OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`, the SDK's own attributes), named `postbox`
/// unless the environment names the service, with the version.
fn resource(var: impl Fn(&str) -> Option<String>) -> Resource {
    let named = var("OTEL_SERVICE_NAME").is_some_and(|v| !v.trim().is_empty())
        || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|v| v.contains("service.name="));
    let builder = Resource::builder().with_attribute(opentelemetry::KeyValue::new(
        "service.version",
        env!("CARGO_PKG_VERSION"),
    ));
    if named {
        builder.build()
    } else {
        builder.with_service_name("postbox").build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn export_is_off_without_an_endpoint_and_when_disabled() {
        assert_eq!(wanted(env(&[])), Wanted::Off);
        assert_eq!(wanted(env(&[("OTEL_SERVICE_NAME", "x")])), Wanted::Off);
        assert_eq!(
            wanted(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])),
            Wanted::Off
        );
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_SDK_DISABLED", "TRUE"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(wanted(env(&[endpoint, off])), Wanted::Off, "{off:?}");
        }
        assert_eq!(
            wanted(env(&[endpoint, ("OTEL_SDK_DISABLED", "false")])),
            Wanted::Otlp {
                endpoint: "http://collector:4318".into(),
                other_protocol: None
            }
        );
    }

    #[test]
    fn the_traces_endpoint_wins_and_a_grpc_protocol_is_named() {
        let got = wanted(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://b:4318/v1/traces",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]));
        assert_eq!(
            got,
            Wanted::Otlp {
                endpoint: "http://b:4318/v1/traces".into(),
                other_protocol: Some("grpc".into())
            }
        );
    }
}
