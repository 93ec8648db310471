//! OpenAI-compatible routes: completions and chat completions (JSON or SSE), models,
//! tokenize / detokenize, and cancellation by request id.

use std::sync::Arc;
use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use actix_web_lab::sse;
use futures::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::json;

use super::AppState;
use super::errors::ApiError;
use super::protocol::{
    ChatRequest, CompletionRequest, Endpoint, MessageIn, Prepared, chat_messages, prepare_chat,
    prepare_completion,
};
use super::responses::{GenEvent, Shaper, merge};
use crate::actors::lora_manager::ListAdapters;
use crate::request::AbortReason;

/// Removes a request from the live table when its response ends or is dropped.
struct LiveGuard {
    state: web::Data<AppState>,
    id: String,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.state.live.remove(&self.id);
    }
}

/// A started generation: its response id and merged event stream.
pub struct Started {
    pub id: String,
    pub prepared: Arc<Prepared>,
    pub events: std::pin::Pin<Box<dyn Stream<Item = GenEvent>>>,
}

/// Submits every prompt of a prepared request to the engine.
pub async fn start(state: &web::Data<AppState>, prepared: Prepared) -> Result<Started, ApiError> {
    if !state.serving() {
        return Err(ApiError::Unavailable("the server is shutting down; no new requests are taken".into()));
    }
    if let Some(why) = state.engine.failure() {
        return Err(ApiError::Unavailable(format!("the engine has failed: {why}")));
    }
    let prefix = match prepared.endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let id = state.new_request_id(prefix);
    let (engine_ids, events) = submit(&state.engine, &id, &prepared).await?;
    state.live.insert(id.clone(), engine_ids);
    if state.engine.config().log_requests {
        tracing::info!(request_id = %id, prompts = prepared.prompts.len(), n = prepared.params.n,
            prompt_tokens = prepared.prompts.iter().map(Vec::len).sum::<usize>(), stream = prepared.stream, "request started");
    }
    let guard = LiveGuard { state: state.clone(), id: id.clone() };
    let events = events.map(move |e| {
        let _keep = &guard;
        e
    });
    Ok(Started { id, prepared: Arc::new(prepared), events: Box::pin(events) })
}

/// Submits every prompt of `prepared` under the response id `id` (`id-<i>` for each of
/// several prompts); returns the engine's request ids and the merged events. Dropping
/// the events aborts the requests.
pub async fn submit(
    engine: &crate::Engine,
    id: &str,
    prepared: &Prepared,
) -> Result<(Vec<String>, impl Stream<Item = GenEvent> + use<>), ApiError> {
    let mut streams = Vec::with_capacity(prepared.prompts.len());
    let mut engine_ids = Vec::with_capacity(prepared.prompts.len());
    for (i, p) in prepared.prompts.iter().enumerate() {
        let eid = if prepared.prompts.len() == 1 { id.to_string() } else { format!("{id}-{i}") };
        let lora = prepared.lora.as_deref();
        streams
            .push(engine.add_request_with_lora(eid.clone(), p.clone(), prepared.params.clone(), lora).await?);
        engine_ids.push(eid);
    }
    Ok((engine_ids, merge(streams, prepared.params.n)))
}

/// The JSON body of a non-streamed response: its events read to the end through `shaper`.
pub async fn whole_response(
    mut events: impl Stream<Item = GenEvent> + Unpin,
    mut shaper: Shaper,
) -> Result<serde_json::Value, ApiError> {
    while let Some(ev) = events.next().await {
        if let GenEvent::Error { message } = &ev {
            return Err(ApiError::Internal(message.clone()));
        }
        let done = matches!(ev, GenEvent::Done { .. });
        shaper.absorb(ev);
        if done {
            break;
        }
    }
    Ok(shaper.response())
}

fn data(v: &serde_json::Value) -> sse::Event {
    sse::Event::Data(sse::Data::new(v.to_string()))
}

/// The SSE body: chunks as OpenAI clients parse them, `[DONE]` at the end, an error object
/// as the last event if the engine fails mid-stream.
fn sse_events(started: Started, shaper: Shaper) -> impl Stream<Item = sse::Event> {
    let Started { events, .. } = started;
    let mut shaper = shaper;
    let opening: Vec<sse::Event> = shaper.opening_chunks().iter().map(data).collect();
    let body = events.scan((shaper, false), |(sh, ended), ev| {
        if *ended {
            return futures::future::ready(None);
        }
        let out: Vec<sse::Event> = match &ev {
            GenEvent::Error { message } => {
                *ended = true;
                let err = ApiError::Internal(message.clone()).body();
                vec![data(&err), sse::Event::Data(sse::Data::new("[DONE]"))]
            }
            GenEvent::Done { .. } => {
                *ended = true;
                let mut v: Vec<sse::Event> = sh.chunks(&ev).iter().map(data).collect();
                v.push(sse::Event::Data(sse::Data::new("[DONE]")));
                v
            }
            _ => sh.chunks(&ev).iter().map(data).collect(),
        };
        futures::future::ready(Some(stream::iter(out)))
    });
    stream::iter(opening).chain(body.flatten())
}

async fn respond(state: web::Data<AppState>, prepared: Prepared) -> Result<HttpResponse, ApiError> {
    let started = start(&state, prepared).await?;
    let shaper = Shaper::new(started.id.clone(), started.prepared.clone(), state.engine.tokenizer().clone());
    let id = started.id.clone();
    if started.prepared.stream {
        let body = sse_events(started, shaper);
        let sse = sse::Sse::from_infallible_stream(body).with_keep_alive(Duration::from_secs(10));
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .insert_header(("X-Request-Id", id))
            .body(sse));
    }
    let body = whole_response(started.events, shaper).await?;
    Ok(HttpResponse::Ok().insert_header(("X-Request-Id", id)).json(body))
}

pub async fn completions(
    state: web::Data<AppState>,
    body: web::Json<CompletionRequest>,
) -> Result<HttpResponse, ApiError> {
    let st = state.clone();
    let prepared =
        web::block(move || prepare_completion(&st.engine, &st.served_model_names, body.into_inner()))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))??;
    respond(state, prepared).await
}

pub async fn chat_completions(
    state: web::Data<AppState>,
    body: web::Json<ChatRequest>,
) -> Result<HttpResponse, ApiError> {
    let st = state.clone();
    let prepared = web::block(move || prepare_chat(&st.engine, &st.served_model_names, body.into_inner()))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    respond(state, prepared).await
}

pub async fn models(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let created = state.started_unix;
    let root = state.engine.config().model_dir.display().to_string();
    let max_len = state.engine.config().max_model_len;
    let mut data: Vec<serde_json::Value> = state
        .served_model_names
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "actorllm", "root": root,
                "parent": null, "max_model_len": max_len,
            })
        })
        .collect();
    if let Some(m) = state.engine.lora_manager() {
        let parent = state.served_model_names.first().cloned().unwrap_or_default();
        let adapters =
            m.send(ListAdapters).await.map_err(|_| ApiError::Unavailable("LoRA manager stopped".into()))?;
        data.extend(adapters.into_iter().map(|a| {
            json!({
                "id": a.name, "object": "model", "created": created, "owned_by": "actorllm",
                "root": a.path.display().to_string(), "parent": parent, "max_model_len": max_len,
            })
        }));
    }
    Ok(HttpResponse::Ok().json(json!({ "object": "list", "data": data })))
}

#[derive(Deserialize)]
pub struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<MessageIn>>,
    #[serde(flatten)]
    template: super::protocol::TemplateFields,
    /// Tools for the chat template, as a chat request gives them.
    tools: Option<Vec<serde_json::Value>>,
    add_special_tokens: Option<bool>,
}

pub async fn tokenize(
    state: web::Data<AppState>,
    body: web::Json<TokenizeRequest>,
) -> Result<HttpResponse, ApiError> {
    let st = state.clone();
    let tokens = web::block(move || -> Result<Vec<u32>, ApiError> {
        let req = body.into_inner();
        super::protocol::resolve_model(&st.served_model_names, &req.model)?;
        let tok = st.engine.tokenizer();
        match (req.prompt, req.messages) {
            (Some(p), None) => Ok(tok.encode(&p, req.add_special_tokens.unwrap_or(true))?),
            (None, Some(msgs)) => {
                let options = crate::tokenizer::ChatTemplateOptions {
                    tools: req.tools.as_deref(),
                    ..req.template.options()
                };
                let text = tok.apply_chat_template_with(&chat_messages(&msgs)?, &options)?;
                Ok(tok.encode(&text, false)?)
            }
            _ => Err(ApiError::bad("give exactly one of prompt or messages", Some("prompt"))),
        }
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))??;
    Ok(HttpResponse::Ok().json(json!({
        "tokens": tokens, "count": tokens.len(), "max_model_len": state.engine.config().max_model_len,
    })))
}

#[derive(Deserialize)]
pub struct DetokenizeRequest {
    tokens: Vec<u32>,
}

pub async fn detokenize(
    state: web::Data<AppState>,
    body: web::Json<DetokenizeRequest>,
) -> Result<HttpResponse, ApiError> {
    let vocab = state.engine.model_config().vocab_size;
    if let Some(bad) = body.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad(
            format!("token id {bad} is out of vocabulary (size {vocab})"),
            Some("tokens"),
        ));
    }
    let text = state.engine.tokenizer().decode(&body.tokens, false)?;
    Ok(HttpResponse::Ok().json(json!({ "prompt": text })))
}

pub async fn cancel(state: web::Data<AppState>, path: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let engine_ids = state.live.get(&id).map(|e| e.value().clone());
    let Some(engine_ids) = engine_ids else {
        return Err(ApiError::NotFound(format!("no running request with id {id}")));
    };
    for eid in engine_ids {
        state.engine.abort(&eid, AbortReason::Cancelled).await;
    }
    Ok(HttpResponse::Ok().json(json!({ "id": id, "cancelled": true })))
}

/// Unknown routes get the OpenAI error shape too.
pub async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::NotFound(format!("no route for {} {}", req.method(), req.path())))
}
