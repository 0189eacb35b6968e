//! `meshctl generate "text"`: one request through the router, streamed to stdout.

use std::io::Write;
use std::time::Duration;

use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;

#[derive(clap::Args)]
pub struct Args {
    /// The user message (or the raw prompt with --raw).
    pub text: String,
    /// Send the text as a raw prompt instead of a chat message.
    #[arg(long)]
    pub raw: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Router address; default: found in the registry.
    #[arg(long, env = "PDMESH_ROUTER_ADDR")]
    pub router_addr: Option<String>,
    /// In a mesh of several models, the model (its pool) to ask.
    #[arg(long)]
    pub model: Option<String>,
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// Deadline of the request, in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub timeout_s: f64,
}

pub async fn run(a: Args) -> Result<(), String> {
    let router = pdmesh_core::discovery::pooled_kind("router", a.model.as_deref());
    let addr =
        pdmesh_core::discovery::address_of(a.router_addr.as_deref(), &router, &*a.discovery.open_or_default()?).await?;
    let ch = pdmesh_core::grpc::lazy_channel(&addr)?;
    let input = if a.raw {
        pb::generate_request::Input::Prompt(a.text)
    } else {
        pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: a.text }],
        })
    };
    let mut req = tonic::Request::new(pb::GenerateRequest {
        request_id: String::new(),
        input: Some(input),
        sampling: Some(common::SamplingParams { temperature: a.temperature, seed: a.seed, ..Default::default() }),
        max_tokens: a.max_tokens,
        stop: vec![],
        ignore_eos: false,
        max_tokens_to_fit: false,
        resume_ids: Vec::new(),
    });
    req.set_timeout(Duration::from_secs_f64(a.timeout_s.max(0.001)));
    let mut s = pb::router_client::RouterClient::new(ch)
        .generate(req)
        .await
        .map_err(|e| pdmesh_core::grpc::status_text(&e))?
        .into_inner();
    let mut out = std::io::stdout();
    loop {
        match s.message().await {
            Ok(Some(pb::GenerateResponse { event: Some(pb::generate_response::Event::Delta(d)) })) => {
                let _ = out.write_all(d.text.as_bytes());
                let _ = out.flush();
            }
            Ok(Some(pb::GenerateResponse { event: Some(pb::generate_response::Event::Finished(f)) })) => {
                let u = f.usage.unwrap_or_default();
                let reason = common::FinishReason::try_from(f.reason).map(|r| r.as_str_name()).unwrap_or("?");
                println!();
                eprintln!(
                    "[finish: {reason}; prompt {} tokens, completion {} tokens]",
                    u.prompt_tokens, u.completion_tokens
                );
                return Ok(());
            }
            Ok(Some(_)) => {}
            Ok(None) => return Err("the router ended the stream without finishing".into()),
            Err(e) => return Err(pdmesh_core::grpc::status_text(&e)),
        }
    }
}
