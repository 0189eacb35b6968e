//! Checking a Generate request before any work is done for it.

use pdmesh_core::vocab::limits;
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;
use tonic::Status;

use crate::error::Error;

/// A malformed request, as its status.
fn bad(why: impl Into<String>) -> Status {
    Error::BadRequest(why.into()).into()
}

/// A validated request, ready to run (its input goes to the tokenizer apart).
#[derive(Clone, Debug)]
pub struct Job {
    pub request_id: String,
    pub sampling: common::SamplingParams,
    pub max_tokens: u32,
    /// `max_tokens` is a default: fewer when the prompt leaves less room.
    pub max_tokens_to_fit: bool,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// When the request must end (set once it is accepted); the prefill
    /// call carries what is left of it, so a prompt that cannot make it is
    /// not started and one whose time is up stops.
    pub deadline: Option<std::time::Instant>,
    /// Tokens the caller already has (a request resumed after its router
    /// was lost): they are not streamed again, and a decode worker takes
    /// them as its first tokens (as after a migration).
    pub replay: Vec<u32>,
}

/// Longest caller-chosen request id.
const MAX_REQUEST_ID: usize = 128;

/// The prompt or chat of a request.
pub type Input = pb::generate_request::Input;

/// Check `r`; `fresh_id` names a request that came without an id.
pub fn validate(
    r: pb::GenerateRequest,
    max_stop: usize,
    fresh_id: impl FnOnce() -> String,
) -> Result<(Input, Job), Status> {
    let input = r.input.ok_or_else(|| bad("set prompt or chat"))?;
    match &input {
        pb::generate_request::Input::Prompt(p) if p.is_empty() => return Err(bad("prompt is empty")),
        pb::generate_request::Input::Chat(c) if c.messages.is_empty() => return Err(bad("messages is empty")),
        _ => {}
    }
    if r.max_tokens == 0 {
        return Err(bad("max_tokens must be at least 1"));
    }
    // As many as max_tokens: the caller lost its router after the last
    // token but before the finish; the finish (and usage) comes at once.
    if r.resume_ids.len() > r.max_tokens as usize {
        return Err(bad("resume_ids must be at most max_tokens: they are tokens of this request"));
    }
    let s = r.sampling.unwrap_or_default();
    if !(0.0..=limits::MAX_TEMPERATURE).contains(&s.temperature) {
        let max = limits::MAX_TEMPERATURE;
        return Err(bad(format!("temperature must be in [0, {max}], got {}", s.temperature)));
    }
    if !(0.0..=1.0).contains(&s.top_p) {
        return Err(bad(format!("top_p must be in (0, 1], got {}", s.top_p)));
    }
    let bytes = limits::MAX_STOP_BYTES;
    if r.stop.len() > max_stop || r.stop.iter().any(|s| s.is_empty() || s.len() > bytes) {
        return Err(bad(format!("stop takes at most {max_stop} non-empty strings of at most {bytes} bytes")));
    }
    let request_id = if r.request_id.is_empty() {
        fresh_id()
    } else if r.request_id.len() > MAX_REQUEST_ID || !r.request_id.chars().all(|c| c.is_ascii_graphic()) {
        return Err(bad("request_id must be at most 128 printable ASCII characters"));
    } else {
        r.request_id
    };
    let job = Job {
        request_id,
        sampling: s,
        max_tokens: r.max_tokens,
        max_tokens_to_fit: r.max_tokens_to_fit,
        stop: r.stop,
        ignore_eos: r.ignore_eos,
        deadline: None,
        replay: r.resume_ids,
    };
    Ok((input, job))
}

/// A default `max_tokens` shortened to the room the prompt leaves in the
/// context (the first generated token needs no position of its own).
pub fn fit_max_tokens(n_prompt: usize, max_tokens: u32, context: u32) -> u32 {
    let room = (context as u64 + 1).saturating_sub(n_prompt as u64);
    (max_tokens as u64).min(room).max(1) as u32
}

/// The prompt must fit the context with room for `max_tokens` (the first
/// token comes from the prompt's own forward).
pub fn check_fits(n_prompt: usize, max_tokens: u32, context: u32) -> Result<(), Status> {
    if n_prompt == 0 {
        return Err(bad("the prompt encodes to no tokens"));
    }
    let needed = n_prompt as u64 + max_tokens as u64 - 1;
    if needed > context as u64 {
        return Err(bad(format!(
            "prompt has {n_prompt} tokens; with max_tokens {max_tokens} it needs {needed} positions but the context \
             holds {context}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_max_tokens_shrinks_to_the_room_left() {
        assert_eq!(fit_max_tokens(10, 256, 8192), 256);
        assert_eq!(fit_max_tokens(8000, 256, 8192), 193);
        assert!(check_fits(8000, fit_max_tokens(8000, 256, 8192), 8192).is_ok());
        assert!(check_fits(8000, 194, 8192).is_err());
        // A prompt that fills the context still fails, as too long.
        assert!(check_fits(8193, fit_max_tokens(8193, 256, 8192), 8192).is_err());
    }

    fn req(prompt: &str, max_tokens: u32) -> pb::GenerateRequest {
        pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Prompt(prompt.into())),
            max_tokens,
            ..Default::default()
        }
    }

    #[test]
    fn bad_requests_say_which_field() {
        let bad = |r, what: &str| {
            let e = validate(r, 4, || "x".into()).expect_err("refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(what), "{} lacks {what}", e.message());
        };
        bad(req("", 8), "prompt");
        bad(req("hi", 0), "max_tokens");
        bad(
            pb::GenerateRequest {
                sampling: Some(common::SamplingParams { temperature: 3.0, ..Default::default() }),
                ..req("hi", 8)
            },
            "temperature",
        );
        bad(pb::GenerateRequest { stop: vec!["".into()], ..req("hi", 8) }, "stop");
        // The gateway's bounds (one home: pdmesh_vocab::limits) hold for gRPC callers too.
        let long = "x".repeat(limits::MAX_STOP_BYTES + 1);
        bad(pb::GenerateRequest { stop: vec![long], ..req("hi", 8) }, "at most 256 bytes");
        bad(pb::GenerateRequest { stop: vec!["a".into(); 5], ..req("hi", 8) }, "at most 4");
        bad(pb::GenerateRequest { request_id: "a b".into(), ..req("hi", 8) }, "request_id");
    }

    #[test]
    fn a_request_without_an_id_gets_a_fresh_one() {
        assert_eq!(validate(req("hi", 8), 4, || "fresh".into()).unwrap().1.request_id, "fresh");
        let own = pb::GenerateRequest { request_id: "mine".into(), ..req("hi", 8) };
        assert_eq!(validate(own, 4, || "fresh".into()).unwrap().1.request_id, "mine");
    }

    #[test]
    fn the_prompt_and_the_answer_must_fit_the_context() {
        assert!(check_fits(100, 29, 128).is_ok());
        assert_eq!(check_fits(100, 30, 128).unwrap_err().code(), tonic::Code::InvalidArgument);
        assert!(check_fits(0, 1, 128).unwrap_err().message().contains("no tokens"));
    }
}
