//! An OTLP/HTTP trace receiver for the tests: it decodes what an exporter
//! sends to `/v1/traces` and keeps every span.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use postbox_testkit::serve_http;
use prost::Message as _;
use std::sync::{Arc, Mutex};

/// A span as this test compares them: ids in lowercase hex.
#[derive(Clone, Debug)]
pub struct Seen {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub attributes: Vec<(String, String)>,
    pub links: Vec<String>,
    pub service: String,
}

impl Seen {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An OTLP/HTTP receiver: decodes `ExportTraceServiceRequest` protobuf on
/// `/v1/traces` and keeps every span, and counts the requests.
pub struct Receiver {
    spans: Arc<Mutex<Vec<Seen>>>,
    requests: Arc<Mutex<usize>>,
    pub endpoint: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

type Kept = (Arc<Mutex<Vec<Seen>>>, Arc<Mutex<usize>>);

async fn export(State((spans, requests)): State<Kept>, body: Bytes) -> impl IntoResponse {
    *requests.lock().unwrap() += 1;
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (axum::http::StatusCode::BAD_REQUEST, Vec::new()).into_response();
    };
    let mut kept = spans.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .and_then(|a| a.value.as_ref()?.value.as_ref())
            .map(|v| match v {
                Value::StringValue(s) => s.clone(),
                other => format!("{other:?}"),
            })
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                let attributes = span
                    .attributes
                    .iter()
                    .map(|a| {
                        let value = match a.value.as_ref().and_then(|v| v.value.as_ref()) {
                            Some(Value::StringValue(s)) => s.clone(),
                            Some(Value::IntValue(i)) => i.to_string(),
                            Some(other) => format!("{other:?}"),
                            None => String::new(),
                        };
                        (a.key.clone(), value)
                    })
                    .collect();
                kept.push(Seen {
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes,
                    links: span.links.iter().map(|l| hex(&l.span_id)).collect(),
                    service: service.clone(),
                });
            }
        }
    }
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    ([(CONTENT_TYPE, "application/x-protobuf")], answer).into_response()
}

impl Receiver {
    pub async fn start() -> Self {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(0));
        let app = axum::Router::new()
            .route("/v1/traces", post(export))
            .with_state((spans.clone(), requests.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        Receiver {
            spans,
            requests,
            endpoint,
            _stop: serve_http(listener, app),
        }
    }

    pub fn spans(&self) -> Vec<Seen> {
        self.spans.lock().unwrap().clone()
    }

    pub fn requests(&self) -> usize {
        *self.requests.lock().unwrap()
    }
}
