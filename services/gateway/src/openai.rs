//! The OpenAI request bodies pdmesh accepts, parsed by hand from JSON so
//! that every mistake gets an OpenAI-style error naming the field.

use pdmesh_core::vocab::limits;
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;
use serde_json::{Map, Value};

/// An error in the request (HTTP 400 unless `status` says otherwise).
#[derive(Debug)]
pub struct BadRequest {
    pub status: u16,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

fn bad(param: &'static str, message: impl Into<String>) -> BadRequest {
    BadRequest { status: 400, message: message.into(), param: Some(param), code: None }
}

pub struct Parsed {
    pub request: pb::GenerateRequest,
    pub stream: bool,
    pub include_usage: bool,
    pub model: String,
}

pub enum Kind {
    Chat,
    Completion,
}

const ROLES: &[&str] = &["system", "user", "assistant", "tool", "developer"];

fn number(o: &Map<String, Value>, key: &'static str) -> Result<Option<f64>, BadRequest> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_f64().map(Some).ok_or_else(|| bad(key, format!("{key} is not a finite number"))),
        Some(_) => Err(bad(key, format!("{key} must be a number"))),
    }
}

fn text_of(content: &Value, i: usize) -> Result<String, BadRequest> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => s.push_str(t),
                    _ => return Err(bad("messages", format!("messages[{i}].content: only text parts are supported"))),
                }
            }
            Ok(s)
        }
        Value::Null => Ok(String::new()),
        _ => Err(bad("messages", format!("messages[{i}].content must be a string or an array of text parts"))),
    }
}

fn invalid(message: String) -> BadRequest {
    BadRequest { status: 400, message, param: None, code: None }
}

/// One of the served models, or 404 naming those that are.
fn model(o: &Map<String, Value>, served: &[String]) -> Result<String, BadRequest> {
    let model = match o.get("model") {
        Some(Value::String(m)) => m.clone(),
        None => return Err(bad("model", "model is required")),
        Some(_) => return Err(bad("model", "model must be a string")),
    };
    if !served.contains(&model) {
        let names: Vec<String> = served.iter().map(|m| format!("`{m}`")).collect();
        return Err(BadRequest {
            status: 404,
            message: format!("The model `{model}` does not exist; this server serves {}", names.join(", ")),
            param: Some("model"),
            code: Some("model_not_found"),
        });
    }
    Ok(model)
}

fn messages(o: &Map<String, Value>) -> Result<pb::generate_request::Input, BadRequest> {
    let msgs = match o.get("messages") {
        Some(Value::Array(a)) => a,
        None => return Err(bad("messages", "messages is required")),
        Some(_) => return Err(bad("messages", "messages must be an array")),
    };
    if msgs.is_empty() {
        return Err(bad("messages", "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("messages", format!("messages[{i}].role is required")))?;
        if !ROLES.contains(&role) {
            return Err(bad("messages", format!("messages[{i}].role {role:?} is not one of {}", ROLES.join(", "))));
        }
        let role = if role == "developer" { "system" } else { role };
        let content = text_of(m.get("content").unwrap_or(&Value::Null), i)?;
        out.push(pb::ChatMessage { role: role.into(), content });
    }
    Ok(pb::generate_request::Input::Chat(pb::ChatMessages { messages: out }))
}

fn prompt(o: &Map<String, Value>) -> Result<pb::generate_request::Input, BadRequest> {
    let p = match o.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
        Some(Value::Array(_)) => {
            return Err(bad("prompt", "prompt must be one string (batches of prompts are not supported)"))
        }
        None => return Err(bad("prompt", "prompt is required")),
        Some(_) => return Err(bad("prompt", "prompt must be a string")),
    };
    if p.is_empty() {
        return Err(bad("prompt", "prompt must not be empty"));
    }
    Ok(pb::generate_request::Input::Prompt(p))
}

/// `max_completion_tokens` (the newer name) or `max_tokens`.
/// The caller's max_tokens, or `default` (then marked as one: the router
/// shortens it to the room the prompt leaves in the context).
fn max_tokens(o: &Map<String, Value>, default: u32) -> Result<(u32, bool), BadRequest> {
    let key = if o.get("max_completion_tokens").is_some_and(|v| !v.is_null()) {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    match number(o, key)? {
        None => Ok((default, true)),
        Some(n) if n.fract() != 0.0 => Err(bad(key, format!("{key} must be an integer, got {n}"))),
        Some(n) if n < 1.0 => Err(bad(key, format!("{key} must be at least 1, got {n}"))),
        Some(n) if n > u32::MAX as f64 => Err(bad(key, format!("{key} is too large: {n}"))),
        Some(n) => Ok((n as u32, false)),
    }
}

/// Temperature, top_p, top_k and seed. Greedy for temperature 0 is exact;
/// other settings sample with the seed.
fn sampling(o: &Map<String, Value>) -> Result<common::SamplingParams, BadRequest> {
    let temperature = number(o, "temperature")?.unwrap_or(1.0);
    if !(0.0..=limits::MAX_TEMPERATURE as f64).contains(&temperature) {
        let max = limits::MAX_TEMPERATURE;
        return Err(bad("temperature", format!("temperature must be between 0 and {max}, got {temperature}")));
    }
    let top_p = number(o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad("top_p", format!("top_p must be in (0, 1], got {top_p}")));
    }
    let top_k = number(o, "top_k")?.unwrap_or(0.0);
    if top_k < 0.0 || top_k.fract() != 0.0 || top_k > 1e9 {
        return Err(bad("top_k", format!("top_k must be a non-negative integer, got {top_k}")));
    }
    let seed = match number(o, "seed")? {
        None => 0,
        Some(s) if s.fract() == 0.0 && s >= 0.0 && s <= u64::MAX as f64 => s as u64,
        Some(s) if s.fract() == 0.0 && s < 0.0 && s >= i64::MIN as f64 => (s as i64) as u64,
        Some(s) => return Err(bad("seed", format!("seed must be an integer, got {s}"))),
    };
    Ok(common::SamplingParams { temperature: temperature as f32, top_k: top_k as u32, top_p: top_p as f32, seed })
}

/// Fields of the OpenAI API this server does not implement: refused when
/// they ask for something, never silently ignored (an empty, null, false
/// or zero value asks for nothing).
const UNSUPPORTED: &[&str] = &[
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
];

fn asks_for_nothing(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || s == "none" || s == "auto",
        Value::Array(a) => a.is_empty(),
        Value::Object(m) => m.is_empty() || m.get("type").and_then(Value::as_str) == Some("text"),
    }
}

fn unsupported(o: &Map<String, Value>) -> Result<(), BadRequest> {
    for &key in UNSUPPORTED {
        match o.get(key) {
            Some(Value::Number(n)) if key == "best_of" && n.as_f64() == Some(1.0) => {}
            Some(v) if !asks_for_nothing(v) => {
                return Err(bad(key, format!("{key} is not supported by this server; leave it out")));
            }
            _ => {}
        }
    }
    Ok(())
}

fn stop(o: &Map<String, Value>) -> Result<Vec<String>, BadRequest> {
    let stop = match o.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            a.iter().filter_map(|s| s.as_str().map(String::from)).collect()
        }
        Some(_) => return Err(bad("stop", "stop must be a string or an array of strings")),
    };
    let (most, bytes) = (limits::MAX_STOP_STRINGS, limits::MAX_STOP_BYTES);
    if stop.len() > most || stop.iter().any(|s| s.is_empty() || s.len() > bytes) {
        return Err(bad("stop", format!("stop takes up to {most} non-empty strings of at most {bytes} bytes")));
    }
    Ok(stop)
}

/// Parse a `/v1/chat/completions` or `/v1/completions` body.
pub fn parse(body: &[u8], kind: Kind, served: &[String], default_max_tokens: u32) -> Result<Parsed, BadRequest> {
    let v: Value = serde_json::from_slice(body).map_err(|e| invalid(format!("request body is not valid JSON: {e}")))?;
    let o = v.as_object().ok_or_else(|| invalid("request body must be a JSON object".into()))?;
    let model = model(o, served)?;
    unsupported(o)?;
    let input = match kind {
        Kind::Chat => messages(o)?,
        Kind::Completion => prompt(o)?,
    };
    let (max_tokens, max_tokens_to_fit) = max_tokens(o, default_max_tokens)?;
    let sampling = sampling(o)?;
    match number(o, "n")? {
        None | Some(1.0) => {}
        Some(n) => return Err(bad("n", format!("only n = 1 is supported, got {n}"))),
    }
    let stop = stop(o)?;
    let stream = match o.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("stream", "stream must be a boolean")),
    };
    let include_usage =
        o.get("stream_options").and_then(|s| s.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let ignore_eos = o.get("ignore_eos").and_then(Value::as_bool).unwrap_or(false);
    Ok(Parsed {
        request: pb::GenerateRequest {
            request_id: String::new(),
            input: Some(input),
            sampling: Some(sampling),
            max_tokens,
            stop,
            ignore_eos,
            max_tokens_to_fit,
            resume_ids: Vec::new(),
        },
        stream,
        include_usage,
        model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Parsed, BadRequest> {
        parse(body.as_bytes(), Kind::Chat, &["m".to_string(), "n".to_string()], 16)
    }

    #[test]
    fn good_chat_request() {
        let p = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"temperature":0,"stream":true,"stop":"x"}"#).unwrap();
        assert!(p.stream);
        assert_eq!(p.request.max_tokens, 5);
        assert_eq!(p.request.stop, vec!["x"]);
        assert_eq!(p.request.sampling.unwrap().temperature, 0.0);
    }

    #[test]
    fn fields_that_ask_for_nothing_are_accepted() {
        let ok = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[],"tool_choice":"none","logprobs":false,"presence_penalty":0,"frequency_penalty":0.0,"response_format":{"type":"text"},"logit_bias":{},"best_of":1,"user":"u1"}"#;
        assert!(chat(ok).is_ok());
        let long_stop =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"stop":"{}"}}"#, "s".repeat(300));
        assert_eq!(chat(&long_stop).err().map(|e| e.param), Some(Some("stop")));
    }

    #[test]
    fn each_mistake_names_its_field() {
        for (body, param, status) in [
            (r#"{"model":"m","messages":[]}"#, Some("messages"), 400),
            (r#"{"model":"m"}"#, Some("messages"), 400),
            (r#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#, Some("messages"), 400),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#, Some("max_tokens"), 400),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-3}"#, Some("max_tokens"), 400),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1e30}"#, Some("max_tokens"), 400),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}"#, Some("temperature"), 400),
            (r#"{"model":"other","messages":[{"role":"user","content":"x"}]}"#, Some("model"), 404),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#, Some("n"), 400),
            (r#"{"model":"m","messages":"#, None, 400),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#,
                Some("tools"),
                400,
            ),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true}"#, Some("logprobs"), 400),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}"#,
                Some("response_format"),
                400,
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"presence_penalty":0.5}"#,
                Some("presence_penalty"),
                400,
            ),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":["x","yyyyyyyyyy"]}"#, None, 0),
        ] {
            if status == 0 {
                assert!(chat(body).is_ok(), "{body}");
                continue;
            }
            let e = chat(body).err().unwrap_or_else(|| panic!("{body} was accepted"));
            assert_eq!((e.param, e.status), (param, status), "{body}: {}", e.message);
        }
    }
}
