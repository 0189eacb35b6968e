//! Finished spans as `meshctl explain` reads them, from three sources: an
//! OTLP/gRPC export (the receiver in [`crate::sink`]), an OTLP/JSON file (one
//! `ExportTraceServiceRequest` per line, as the OpenTelemetry Collector's
//! file exporter and `meshctl collect` write), and Jaeger's query API
//! (`/api/traces/<id>`).

use std::collections::BTreeMap;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use serde_json::{json, Value};

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_id: String,
    pub name: String,
    /// `pdmesh-<service>` (from the resource, else the span's own attribute).
    pub service: String,
    /// `server`, `client`, `internal`, `producer`, `consumer` or `unspecified`.
    pub kind: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attrs: BTreeMap<String, Value>,
    /// (trace id, span id) of each linked span.
    pub links: Vec<(String, String)>,
    pub error: bool,
    /// The error status's description (empty when none).
    pub status_message: String,
    /// Events recorded on the span (logs, `exception`), in order.
    pub events: Vec<Event>,
}

/// An event on a span: its name (for a log, the message) and attributes.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub name: String,
    pub time_ns: u64,
    pub attrs: BTreeMap<String, Value>,
}

impl Event {
    /// An `exception` event, or a log at level ERROR.
    pub fn is_error(&self) -> bool {
        self.name == "exception" || self.attrs.get("level").and_then(|v| v.as_str()) == Some("ERROR")
    }

    /// What the event says went wrong.
    pub fn message(&self) -> String {
        let a = |k: &str| self.attrs.get(k).and_then(|v| v.as_str()).map(str::to_string);
        a("exception.message").or_else(|| a("exception.type")).unwrap_or_else(|| self.name.clone())
    }
}

impl Span {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }

    pub fn attr_f64(&self, key: &str) -> Option<f64> {
        match self.attrs.get(key)? {
            Value::Number(n) => n.as_f64(),
            Value::String(s) => s.parse().ok(),
            _ => None,
        }
    }

    pub fn attr_str(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).and_then(|v| v.as_str())
    }

    pub fn attr_bool(&self, key: &str) -> Option<bool> {
        match self.attrs.get(key)? {
            Value::Bool(b) => Some(*b),
            Value::String(s) => s.parse().ok(),
            _ => None,
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn any_to_json(v: &AnyValue) -> Value {
    match &v.value {
        Some(any_value::Value::StringValue(s)) => json!(s),
        Some(any_value::Value::BoolValue(b)) => json!(b),
        Some(any_value::Value::IntValue(i)) => json!(i),
        Some(any_value::Value::DoubleValue(d)) => json!(d),
        Some(any_value::Value::ArrayValue(a)) => Value::Array(a.values.iter().map(any_to_json).collect()),
        _ => Value::Null,
    }
}

fn attrs_map(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter().map(|kv| (kv.key.clone(), kv.value.as_ref().map(any_to_json).unwrap_or(Value::Null))).collect()
}

fn kind_name(k: i32) -> &'static str {
    match k {
        1 => "internal",
        2 => "server",
        3 => "client",
        4 => "producer",
        5 => "consumer",
        _ => "unspecified",
    }
}

/// Flatten an OTLP export into spans.
pub fn from_otlp(req: &ExportTraceServiceRequest) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in &req.resource_spans {
        let res = rs.resource.as_ref().map(|r| attrs_map(&r.attributes)).unwrap_or_default();
        let res_service = res.get("service.name").and_then(|v| v.as_str()).map(str::to_string);
        for ss in &rs.scope_spans {
            for s in &ss.spans {
                let attrs = attrs_map(&s.attributes);
                let service = res_service
                    .clone()
                    .or_else(|| attrs.get("service.name").and_then(|v| v.as_str()).map(str::to_string))
                    .unwrap_or_default();
                out.push(Span {
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_id: hex(&s.parent_span_id),
                    name: s.name.clone(),
                    service,
                    kind: kind_name(s.kind).into(),
                    start_ns: s.start_time_unix_nano,
                    end_ns: s.end_time_unix_nano,
                    attrs,
                    links: s.links.iter().map(|l| (hex(&l.trace_id), hex(&l.span_id))).collect(),
                    error: s.status.as_ref().is_some_and(|st| st.code == 2),
                    status_message: s.status.as_ref().map(|st| st.message.clone()).unwrap_or_default(),
                    events: s
                        .events
                        .iter()
                        .map(|e| Event {
                            name: e.name.clone(),
                            time_ns: e.time_unix_nano,
                            attrs: attrs_map(&e.attributes),
                        })
                        .collect(),
                });
            }
        }
    }
    out
}

fn json_attr(k: &str, v: &Value) -> Value {
    let value = match v {
        Value::Bool(b) => json!({ "boolValue": b }),
        Value::Number(n) if n.is_i64() => json!({ "intValue": n.to_string() }),
        Value::Number(n) => json!({ "doubleValue": n.as_f64() }),
        Value::String(s) => json!({ "stringValue": s }),
        other => json!({ "stringValue": other.to_string() }),
    };
    json!({ "key": k, "value": value })
}

fn kind_number(k: &str) -> i32 {
    match k {
        "internal" => 1,
        "server" => 2,
        "client" => 3,
        "producer" => 4,
        "consumer" => 5,
        _ => 0,
    }
}

/// One OTLP/JSON line (an `ExportTraceServiceRequest`) holding `spans`.
pub fn to_otlp_json(spans: &[Span]) -> Value {
    let mut by_service: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for s in spans {
        let v = json!({
            "traceId": s.trace_id,
            "spanId": s.span_id,
            "parentSpanId": s.parent_id,
            "name": s.name,
            "kind": kind_number(&s.kind),
            "startTimeUnixNano": s.start_ns.to_string(),
            "endTimeUnixNano": s.end_ns.to_string(),
            "attributes": s.attrs.iter().map(|(k, v)| json_attr(k, v)).collect::<Vec<_>>(),
            "links": s.links.iter().map(|(t, i)| json!({ "traceId": t, "spanId": i })).collect::<Vec<_>>(),
            "status": { "code": if s.error { 2 } else { 0 }, "message": s.status_message },
            "events": s.events.iter().map(|e| json!({
                "name": e.name,
                "timeUnixNano": e.time_ns.to_string(),
                "attributes": e.attrs.iter().map(|(k, v)| json_attr(k, v)).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        by_service.entry(&s.service).or_default().push(v);
    }
    json!({
        "resourceSpans": by_service.into_iter().map(|(svc, spans)| json!({
            "resource": { "attributes": [json_attr("service.name", &json!(svc))] },
            "scopeSpans": [{ "scope": { "name": "pdmesh" }, "spans": spans }],
        })).collect::<Vec<_>>()
    })
}

fn json_value(v: &Value) -> Value {
    // OTLP/JSON: {"stringValue": ..} | {"intValue": "12"} | {"doubleValue": ..} | {"boolValue": ..}
    if let Some(s) = v.get("stringValue") {
        return s.clone();
    }
    if let Some(i) = v.get("intValue") {
        return match i {
            Value::String(s) => s.parse::<i64>().map(Value::from).unwrap_or(Value::Null),
            other => other.clone(),
        };
    }
    if let Some(d) = v.get("doubleValue") {
        return d.clone();
    }
    if let Some(b) = v.get("boolValue") {
        return b.clone();
    }
    Value::Null
}

fn json_attrs(v: Option<&Value>) -> BTreeMap<String, Value> {
    v.and_then(|a| a.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|kv| {
                    Some((kv.get("key")?.as_str()?.to_string(), kv.get("value").map(json_value).unwrap_or(Value::Null)))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn num(v: Option<&Value>) -> u64 {
    match v {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
        _ => 0,
    }
}

/// Ids in OTLP/JSON are hex; some writers use base64 (the generic protobuf
/// JSON mapping). Normalise to lowercase hex.
fn json_id(v: Option<&Value>, len: usize) -> String {
    let s = v.and_then(|v| v.as_str()).unwrap_or_default();
    if s.len() == 2 * len && s.chars().all(|c| c.is_ascii_hexdigit()) {
        return s.to_ascii_lowercase();
    }
    if s.is_empty() {
        return String::new();
    }
    base64_decode(s).map(|b| hex(&b)).unwrap_or_else(|| s.to_string())
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes().filter(|c| *c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        } as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// Spans from one OTLP/JSON document (an `ExportTraceServiceRequest`).
pub fn from_otlp_json(doc: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in doc.get("resourceSpans").and_then(|v| v.as_array()).into_iter().flatten() {
        let res = json_attrs(rs.get("resource").and_then(|r| r.get("attributes")));
        let res_service = res.get("service.name").and_then(|v| v.as_str()).map(str::to_string);
        for ss in rs.get("scopeSpans").and_then(|v| v.as_array()).into_iter().flatten() {
            for s in ss.get("spans").and_then(|v| v.as_array()).into_iter().flatten() {
                let attrs = json_attrs(s.get("attributes"));
                let service = res_service
                    .clone()
                    .or_else(|| attrs.get("service.name").and_then(|v| v.as_str()).map(str::to_string))
                    .unwrap_or_default();
                let kind = match s.get("kind") {
                    Some(Value::Number(n)) => kind_name(n.as_i64().unwrap_or(0) as i32).to_string(),
                    Some(Value::String(k)) => k.trim_start_matches("SPAN_KIND_").to_ascii_lowercase(),
                    _ => "unspecified".into(),
                };
                out.push(Span {
                    trace_id: json_id(s.get("traceId"), 16),
                    span_id: json_id(s.get("spanId"), 8),
                    parent_id: json_id(s.get("parentSpanId"), 8),
                    name: s.get("name").and_then(|v| v.as_str()).unwrap_or_default().to_string(),
                    service,
                    kind,
                    start_ns: num(s.get("startTimeUnixNano")),
                    end_ns: num(s.get("endTimeUnixNano")),
                    attrs,
                    links: s
                        .get("links")
                        .and_then(|v| v.as_array())
                        .into_iter()
                        .flatten()
                        .map(|l| (json_id(l.get("traceId"), 16), json_id(l.get("spanId"), 8)))
                        .collect(),
                    error: s
                        .get("status")
                        .and_then(|st| st.get("code"))
                        .is_some_and(|c| c == 2 || c == "STATUS_CODE_ERROR"),
                    status_message: s
                        .get("status")
                        .and_then(|st| st.get("message"))
                        .and_then(|m| m.as_str())
                        .unwrap_or_default()
                        .to_string(),
                    events: s
                        .get("events")
                        .and_then(|v| v.as_array())
                        .into_iter()
                        .flatten()
                        .map(|e| Event {
                            name: e.get("name").and_then(|v| v.as_str()).unwrap_or_default().to_string(),
                            time_ns: num(e.get("timeUnixNano")),
                            attrs: json_attrs(e.get("attributes")),
                        })
                        .collect(),
                });
            }
        }
    }
    out
}

/// Every span of `trace_id` in an OTLP/JSON-lines file.
pub fn read_otlp_file(path: &std::path::Path, trace_id: &str) -> Result<Vec<Span>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let want = trace_id.to_ascii_lowercase();
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let doc: Value =
            serde_json::from_str(line).map_err(|e| format!("{} line {}: not JSON: {e}", path.display(), i + 1))?;
        out.extend(from_otlp_json(&doc).into_iter().filter(|s| s.trace_id == want));
    }
    Ok(out)
}

/// Spans of the first trace in a Jaeger `/api/traces/<id>` answer.
pub fn from_jaeger(doc: &Value) -> Result<Vec<Span>, String> {
    let trace = doc.get("data").and_then(|d| d.as_array()).and_then(|d| d.first()).ok_or("Jaeger returned no trace")?;
    let processes = trace.get("processes").cloned().unwrap_or(Value::Null);
    let mut out = Vec::new();
    for s in trace.get("spans").and_then(|v| v.as_array()).into_iter().flatten() {
        let mut attrs = BTreeMap::new();
        for t in s.get("tags").and_then(|v| v.as_array()).into_iter().flatten() {
            if let (Some(k), Some(v)) = (t.get("key").and_then(|k| k.as_str()), t.get("value")) {
                attrs.insert(k.to_string(), v.clone());
            }
        }
        let pid = s.get("processID").and_then(|v| v.as_str()).unwrap_or_default();
        let service = processes
            .get(pid)
            .and_then(|p| p.get("serviceName"))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string();
        let refs: Vec<&Value> =
            s.get("references").and_then(|v| v.as_array()).map(|r| r.iter().collect()).unwrap_or_default();
        // Jaeger's model: the first reference is the parent. A span whose
        // parent is also one of its links (a batch step under its first
        // request) comes with that reference as FOLLOWS_FROM only.
        let trace_id = s.get("traceID").and_then(|v| v.as_str()).unwrap_or_default();
        let ref_type = |r: &&&Value| r.get("refType").and_then(|t| t.as_str()).map(str::to_string);
        let parent = refs
            .iter()
            .find(|r| ref_type(r).as_deref() == Some("CHILD_OF"))
            .or_else(|| refs.iter().find(|r| r.get("traceID").and_then(|v| v.as_str()) == Some(trace_id)))
            .and_then(|r| r.get("spanID"))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string();
        let links = refs
            .iter()
            .filter(|r| ref_type(r).as_deref() == Some("FOLLOWS_FROM"))
            .filter_map(|r| Some((r.get("traceID")?.as_str()?.to_string(), r.get("spanID")?.as_str()?.to_string())))
            .collect();
        let start_us = s.get("startTime").and_then(|v| v.as_u64()).unwrap_or(0);
        let dur_us = s.get("duration").and_then(|v| v.as_u64()).unwrap_or(0);
        let kind = attrs.get("span.kind").and_then(|v| v.as_str()).unwrap_or("internal").to_string();
        let error = attrs.get("error").is_some_and(|v| v == true || v == "true")
            || attrs.get("otel.status_code").is_some_and(|v| v == "ERROR");
        let status_message =
            attrs.get("otel.status_description").and_then(|v| v.as_str()).unwrap_or_default().to_string();
        let events = s
            .get("logs")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .map(|l| {
                let mut attrs: BTreeMap<String, Value> = BTreeMap::new();
                for f in l.get("fields").and_then(|v| v.as_array()).into_iter().flatten() {
                    if let (Some(k), Some(v)) = (f.get("key").and_then(|k| k.as_str()), f.get("value")) {
                        attrs.insert(k.to_string(), v.clone());
                    }
                }
                let name = attrs.remove("event").and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
                Event { name, time_ns: l.get("timestamp").and_then(|v| v.as_u64()).unwrap_or(0) * 1000, attrs }
            })
            .collect();
        out.push(Span {
            trace_id: trace_id.to_string(),
            span_id: s.get("spanID").and_then(|v| v.as_str()).unwrap_or_default().to_string(),
            parent_id: parent,
            name: s.get("operationName").and_then(|v| v.as_str()).unwrap_or_default().to_string(),
            service,
            kind,
            start_ns: start_us * 1000,
            end_ns: (start_us + dur_us) * 1000,
            attrs,
            links,
            error,
            status_message,
            events,
        });
    }
    Ok(out)
}

/// Random hex digits, `bytes` of them (std's per-instance random hash
/// keys; no extra crate): fresh trace and span ids for a caller's own
/// trace context (`meshctl probe`, tests).
pub fn random_hex(bytes: usize) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::new();
    while out.len() < 2 * bytes {
        out += &format!("{:016x}", std::collections::hash_map::RandomState::new().build_hasher().finish());
    }
    out.truncate(2 * bytes);
    out
}

/// Parse a hex trace id given on the command line.
pub fn parse_trace_id(s: &str) -> Result<String, String> {
    let s = s.trim().to_ascii_lowercase();
    if s.len() == 32 && s.chars().all(|c| c.is_ascii_hexdigit()) && s != "0".repeat(32) {
        Ok(s)
    } else {
        Err(format!("a trace id is 32 hex digits, got {s:?}"))
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use pdmesh_core::vocab::rpc;

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn span(
        id: &str,
        parent: &str,
        name: &str,
        service: &str,
        kind: &str,
        start_ms: u64,
        end_ms: u64,
        attrs: &[(&str, Value)],
    ) -> Span {
        Span {
            trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
            span_id: id.into(),
            parent_id: parent.into(),
            name: name.into(),
            service: service.into(),
            kind: kind.into(),
            start_ns: start_ms * 1_000_000,
            end_ns: end_ms * 1_000_000,
            attrs: attrs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
            links: vec![],
            error: false,
            status_message: String::new(),
            events: vec![],
        }
    }

    /// The same spans in Jaeger's `/api/traces/<id>` shape (a hand-made
    /// document following Jaeger's query API, not a real Jaeger).
    pub(crate) fn as_jaeger(spans: &[Span]) -> Value {
        let services: Vec<&str> = spans.iter().map(|s| s.service.as_str()).collect();
        let pid = |svc: &str| format!("p{}", services.iter().position(|s| *s == svc).unwrap());
        json!({ "data": [{
            "traceID": spans[0].trace_id,
            "spans": spans.iter().map(|s| json!({
                "traceID": s.trace_id, "spanID": s.span_id, "operationName": s.name,
                "references": if s.parent_id.is_empty() { json!([]) } else { json!([{ "refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_id }]) },
                "startTime": s.start_ns / 1000, "duration": (s.end_ns - s.start_ns) / 1000,
                "tags": s.attrs.iter().map(|(k, v)| json!({ "key": k, "type": "string", "value": v })).chain(std::iter::once(json!({ "key": "span.kind", "type": "string", "value": s.kind }))).collect::<Vec<_>>(),
                "processID": pid(&s.service),
            })).collect::<Vec<_>>(),
            "processes": spans.iter().map(|s| (pid(&s.service), json!({ "serviceName": s.service }))).collect::<serde_json::Map<_, _>>(),
        }]})
    }

    pub(crate) fn sample() -> Vec<Span> {
        vec![
            span(
                "0000000000000001",
                "",
                "POST /v1/chat/completions",
                "pdmesh-gateway",
                "server",
                0,
                1000,
                &[("gateway.client_tail_ms", json!(100.0))],
            ),
            span("0000000000000002", "0000000000000001", rpc::ROUTER_GENERATE, "pdmesh-router", "server", 2, 890, &[]),
            span(
                "0000000000000003",
                "0000000000000002",
                "tokenize",
                "pdmesh-router",
                "internal",
                3,
                8,
                &[("prompt_tokens", json!(30))],
            ),
            span(
                "0000000000000004",
                "0000000000000002",
                rpc::PREFILL_PREFILL,
                "pdmesh-prefill",
                "server",
                10,
                400,
                &[],
            ),
            span(
                "0000000000000005",
                "0000000000000004",
                "queued",
                "pdmesh-prefill",
                "internal",
                11,
                300,
                &[("prefill.running", json!(3)), ("prefill.queue_depth", json!(5))],
            ),
            span(
                "0000000000000006",
                "0000000000000004",
                "prefill_forward",
                "pdmesh-prefill",
                "internal",
                300,
                350,
                &[],
            ),
            span(
                "0000000000000007",
                "0000000000000004",
                "kv_transfer",
                "pdmesh-prefill",
                "internal",
                352,
                398,
                &[("kv.transport", json!("nixl"))],
            ),
            span("0000000000000008", "0000000000000002", rpc::DECODE_GENERATE, "pdmesh-decode", "server", 10, 880, &[]),
            span("0000000000000009", "0000000000000008", "admit", "pdmesh-decode", "internal", 10, 15, &[]),
            span(
                "000000000000000a",
                "0000000000000008",
                "decode_loop",
                "pdmesh-decode",
                "internal",
                400,
                880,
                &[("decode.steps", json!(31))],
            ),
            span(
                "000000000000000b",
                "0000000000000002",
                "detokenize",
                "pdmesh-router",
                "internal",
                9,
                890,
                &[("detokenize.calls", json!(31))],
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{as_jaeger, sample};
    use super::*;

    #[test]
    fn otlp_json_reads_back_the_same_spans() {
        let spans = sample();
        let back = from_otlp_json(&to_otlp_json(&spans));
        let mut a = spans.clone();
        let mut b = back.clone();
        a.sort_by(|x, y| x.span_id.cmp(&y.span_id));
        b.sort_by(|x, y| x.span_id.cmp(&y.span_id));
        assert_eq!(a, b);
        assert_eq!(from_jaeger(&as_jaeger(&spans)).unwrap().len(), spans.len());
    }

    #[test]
    fn a_jaeger_span_whose_parent_is_also_its_link_keeps_its_parent() {
        // What the real Jaeger v1.75 gives for a batch step: its parent (the
        // first request's span) only as a FOLLOWS_FROM reference.
        let doc = json!({ "data": [{ "processes": { "p1": { "serviceName": "pdmesh-decode" } }, "spans": [
            { "traceID": "t", "spanID": "loop", "operationName": "decode_loop", "references": [],
              "startTime": 1, "duration": 5, "tags": [], "processID": "p1" },
            { "traceID": "t", "spanID": "step", "operationName": "decode_step", "startTime": 2, "duration": 1,
              "references": [{ "refType": "FOLLOWS_FROM", "traceID": "t", "spanID": "loop" },
                             { "refType": "FOLLOWS_FROM", "traceID": "u", "spanID": "other" }],
              "tags": [], "processID": "p1" },
        ]}]});
        let spans = from_jaeger(&doc).unwrap();
        let step = spans.iter().find(|s| s.name == "decode_step").unwrap();
        assert_eq!(step.parent_id, "loop");
        assert_eq!(step.links, vec![("t".to_string(), "loop".to_string()), ("u".to_string(), "other".to_string())]);
        assert_eq!(spans.iter().find(|s| s.name == "decode_loop").unwrap().parent_id, "");
    }

    #[test]
    fn trace_ids_are_checked() {
        assert!(parse_trace_id("0AF7651916CD43DD8448EB211C80319C").is_ok());
        assert!(parse_trace_id("xyz").is_err());
        assert!(parse_trace_id(&"0".repeat(32)).is_err());
    }
}
