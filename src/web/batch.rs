//! `actorllm run-batch`, as vLLM's: OpenAI batch-format JSONL in, one line per request
//! (`custom_id`, `method`, `url`, `body`), and one JSONL line out per input line, written
//! as each finishes. Every request is submitted to the engine at once and batched
//! continuously; each goes through the same validation and response shaping as the HTTP
//! route of its `url`, so a greedy text equals what the server answers.
//!
//! An output line is OpenAI's: `{"id", "custom_id", "response": {"status_code",
//! "request_id", "body"}, "error"}`. A request the route refuses has its status and
//! OpenAI's error object as `response`; a line that is not a request at all (bad JSON, no
//! `custom_id`, another method or URL, `stream`) has `response: null` and an `error` of
//! `{"code", "message"}`. No line stops the batch.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use actix_web::ResponseError;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::{Value, json};

use super::errors::ApiError;
use super::openai::{submit, whole_response};
use super::protocol::{ChatRequest, CompletionRequest, Endpoint, prepare_chat, prepare_completion};
use super::responses::Shaper;
use crate::config::EngineArgs;
use crate::engine::{Engine, EngineError};

#[derive(Debug, clap::Args)]
pub struct RunBatchArgs {
    /// The batch: one JSON request per line.
    #[arg(short = 'i', long)]
    pub input_file: PathBuf,
    /// Where the results go, one JSON line per input line, in the order they finish.
    #[arg(short = 'o', long)]
    pub output_file: PathBuf,
    /// Names a request's `model` may use (defaults to the `--model` argument as given).
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// No progress bar (it is drawn on a terminal only in any case).
    #[arg(long)]
    pub disable_progress_bar: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// What a batch did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct BatchSummary {
    pub requests: usize,
    pub succeeded: usize,
    pub failed: usize,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub seconds: f64,
}

impl BatchSummary {
    pub fn output_tokens_per_s(&self) -> f64 {
        self.completion_tokens as f64 / self.seconds.max(1e-9)
    }
    pub fn total_tokens_per_s(&self) -> f64 {
        (self.prompt_tokens + self.completion_tokens) as f64 / self.seconds.max(1e-9)
    }
}

/// A line that is not a request the batch can run.
struct LineError {
    custom_id: Value,
    code: &'static str,
    message: String,
}

/// The routes a batch line may name.
enum Route {
    Completions(Box<CompletionRequest>),
    Chat(Box<ChatRequest>),
}

/// Starts the engine, runs the batch of `args.input_file` into `args.output_file` and
/// prints a summary.
pub async fn run(args: RunBatchArgs) -> Result<BatchSummary, EngineError> {
    let names = super::served_names(&args.served_model_name, &args.engine);
    let input = args.input_file.clone();
    let text = actix_rt::task::spawn_blocking(move || std::fs::read_to_string(&input))
        .await
        .map_err(|e| EngineError::Server(format!("reading the batch: {e}")))?
        .map_err(|e| EngineError::Server(format!("--input-file {}: {e}", args.input_file.display())))?;
    let out = std::fs::File::create(&args.output_file)
        .map_err(|e| EngineError::Server(format!("--output-file {}: {e}", args.output_file.display())))?;
    let engine = Engine::start(args.engine).await?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let bar = progress_bar(lines.len(), args.disable_progress_bar);
    let mut out = std::io::BufWriter::new(out);
    let started = Instant::now();
    let summary = run_lines(&engine, Arc::new(names), &lines, |line| {
        bar.inc(1);
        writeln!(out, "{line}").map_err(|e| EngineError::Server(format!("writing the results: {e}")))
    })
    .await?;
    out.flush().map_err(|e| EngineError::Server(format!("writing the results: {e}")))?;
    bar.finish_and_clear();
    let summary = BatchSummary { seconds: started.elapsed().as_secs_f64(), ..summary };
    eprintln!(
        "{} requests ({} succeeded, {} failed): {} prompt + {} generated tokens in {:.2} s, {:.1} generated \
         tokens/s, {:.1} tokens/s in all",
        summary.requests,
        summary.succeeded,
        summary.failed,
        summary.prompt_tokens,
        summary.completion_tokens,
        summary.seconds,
        summary.output_tokens_per_s(),
        summary.total_tokens_per_s()
    );
    Ok(summary)
}

fn progress_bar(len: usize, disabled: bool) -> indicatif::ProgressBar {
    if disabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "Running batch: {percent:>3}% |{bar:30}| {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}]",
    ) {
        bar.set_style(style);
    }
    bar
}

/// Runs `lines` on `engine` at once and hands each result line to `emit` as it finishes;
/// returns the counts (the time is the caller's).
pub async fn run_lines(
    engine: &Engine,
    served: Arc<Vec<String>>,
    lines: &[&str],
    mut emit: impl FnMut(String) -> Result<(), EngineError>,
) -> Result<BatchSummary, EngineError> {
    let mut summary = BatchSummary { requests: lines.len(), ..Default::default() };
    let mut running = FuturesUnordered::new();
    for (n, line) in lines.iter().enumerate() {
        match parse_line(line, n + 1) {
            Err(e) => {
                summary.failed += 1;
                emit(error_line(&e, engine.next_request_id("batch-req")).to_string())?;
            }
            Ok((custom_id, route)) => running.push(run_one(engine.clone(), served.clone(), custom_id, route)),
        }
    }
    while let Some(line) = running.next().await {
        match line["response"]["status_code"].as_u64() {
            Some(200) => {
                summary.succeeded += 1;
                let usage = &line["response"]["body"]["usage"];
                summary.prompt_tokens += usage["prompt_tokens"].as_u64().unwrap_or(0);
                summary.completion_tokens += usage["completion_tokens"].as_u64().unwrap_or(0);
            }
            _ => summary.failed += 1,
        }
        emit(line.to_string())?;
    }
    Ok(summary)
}

/// Parses line `n` of the batch into its `custom_id` and route.
fn parse_line(line: &str, n: usize) -> Result<(String, Route), LineError> {
    let invalid =
        |custom_id: Value, message: String| LineError { custom_id, code: "invalid_request", message };
    let v: Value = serde_json::from_str(line)
        .map_err(|e| invalid(Value::Null, format!("line {n} is not valid JSON: {e}")))?;
    let custom_id = match &v["custom_id"] {
        Value::String(s) => s.clone(),
        _ => return Err(invalid(v["custom_id"].clone(), format!("line {n} has no string custom_id"))),
    };
    let id = Value::String(custom_id.clone());
    let method = v["method"].as_str().unwrap_or("");
    if !method.eq_ignore_ascii_case("POST") {
        return Err(invalid(id, format!("method {method:?} is not supported: a batch request is a POST")));
    }
    let body = v.get("body").cloned().unwrap_or(Value::Null);
    if !body.is_object() {
        return Err(invalid(id, "body must be a JSON object".into()));
    }
    if body["stream"].as_bool() == Some(true) {
        return Err(invalid(id, "Request must not be sent in stream mode".into()));
    }
    let bad_body = |e: serde_json::Error| invalid(id.clone(), format!("Invalid request body: {e}"));
    let route = match v["url"].as_str().unwrap_or("") {
        "/v1/completions" => Route::Completions(Box::new(serde_json::from_value(body).map_err(bad_body)?)),
        "/v1/chat/completions" => Route::Chat(Box::new(serde_json::from_value(body).map_err(bad_body)?)),
        other => {
            return Err(invalid(
                id,
                format!(
                    "URL {other:?} is not supported: a batch request goes to /v1/completions or /v1/chat/completions"
                ),
            ));
        }
    };
    Ok((custom_id, route))
}

/// Validates and runs one request; its output line, success or refusal.
async fn run_one(engine: Engine, served: Arc<Vec<String>>, custom_id: String, route: Route) -> Value {
    let request_id = engine.next_request_id("batch-req");
    let result = async {
        let job_engine = engine.clone();
        let prepared = actix_rt::task::spawn_blocking(move || match route {
            Route::Completions(r) => prepare_completion(&job_engine, &served, *r),
            Route::Chat(r) => prepare_chat(&job_engine, &served, *r),
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
        let id = engine.next_request_id(match prepared.endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        });
        let (_, events) = submit(&engine, &id, &prepared).await?;
        let shaper = Shaper::new(id, Arc::new(prepared), engine.tokenizer().clone());
        whole_response(Box::pin(events), shaper).await
    }
    .await;
    let response = match result {
        Ok(body) => json!({"status_code": 200, "request_id": request_id, "body": body}),
        Err(e) => {
            json!({"status_code": e.status_code().as_u16(), "request_id": request_id, "body": e.body()})
        }
    };
    json!({"id": request_id, "custom_id": custom_id, "response": response, "error": null})
}

fn error_line(e: &LineError, id: String) -> Value {
    json!({
        "id": id,
        "custom_id": e.custom_id,
        "response": Value::Null,
        "error": {"code": e.code, "message": e.message},
    })
}
