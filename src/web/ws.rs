//! WebSocket sessions at `/v1/ws`: one actor per connection (actix-web-actors). JSON text
//! frames; many generations run concurrently on one socket, each under a client-chosen id.
//!
//! Client → server:
//! `{"type":"generate","id":"a","endpoint":"chat"|"completions","request":{…HTTP body…}}`,
//! `{"type":"cancel","id":"a"}`.
//! Server → client: `{"type":"started","id","request_id","model"}`, then
//! `{"type":"delta","id","index","text","token_ids":[…],"logprobs"?}` per token, then
//! `{"type":"done","id","finish_reason","choices":[{"index","finish_reason"}],"usage"}`
//! (a chat request read for tool calls or reasoning also gets each choice's `message`, as
//! the HTTP response has it: `content`, `reasoning_content`, `tool_calls`);
//! errors as `{"type":"error","id","error":{…OpenAI error…}}` without closing the socket.
//! Heartbeat: the server pings every 5 s and closes a socket silent for `--ws-idle-timeout`
//! (30 s; shorter timeouts ping six times within it). A closed socket aborts all of its
//! generations.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_web::{HttpRequest, HttpResponse, web};
use actix_web_actors::ws;
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::errors::ApiError;
use super::openai::start;
use super::protocol::{ChatRequest, CompletionRequest, Prepared, prepare_chat, prepare_completion};
use super::responses::{GenEvent, Shaper, prompt_logprobs_json};
use super::shutdown::{Phase, watch_phase};
use super::ws_frames::{FrameGuard, Ledger};
use crate::request::{AbortReason, FinishReason};

/// The longest time between two pings (with the default `--ws-idle-timeout` of 30 s).
const HEARTBEAT: Duration = Duration::from_secs(5);
/// Largest accepted frame, and largest message once its fragments are joined.
pub const MAX_FRAME: usize = 1 << 20;
/// Most bytes read from one socket ahead of what its session has handled.
pub const MAX_BUFFERED: usize = 4 << 20;
/// Most generations one socket may run at once.
pub const MAX_CONCURRENT: usize = 64;

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum ClientFrame {
    Generate { id: String, endpoint: WsEndpoint, request: Value },
    Cancel { id: String },
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum WsEndpoint {
    Chat,
    Completions,
}

struct Generation {
    /// The server's request id once started (for the engine abort).
    request_id: Option<String>,
    finish: Vec<Option<FinishReason>>,
    /// A chat read for tool calls or reasoning: its whole message goes in the done frame.
    reader: Option<Shaper>,
}

pub struct WsSession {
    state: web::Data<AppState>,
    last_heard: Instant,
    running: HashMap<String, Generation>,
    /// Shared with the socket's [`FrameGuard`]: frames handled, and why input was cut.
    ledger: Rc<Ledger>,
    /// A fragmented message being joined: whether it is text, and its bytes so far.
    joining: Option<(bool, Vec<u8>)>,
    /// The server's phase: at the cut the session closes (1001) once its generations
    /// have sent their error frames.
    phase: tokio::sync::watch::Receiver<Phase>,
}

fn error_frame(id: Option<&str>, e: &ApiError) -> String {
    let mut v = e.body();
    v["type"] = json!("error");
    v["id"] = json!(id);
    v.to_string()
}

/// Validates a generate frame's request as the matching HTTP endpoint would.
fn prepare(state: &AppState, endpoint: WsEndpoint, request: Value) -> Result<Prepared, ApiError> {
    let bad = |e: serde_json::Error| ApiError::bad(format!("Invalid request body: {e}"), None);
    let (engine, name) = (&state.engine, &state.served_model_names);
    match endpoint {
        WsEndpoint::Chat => {
            prepare_chat(engine, name, serde_json::from_value::<ChatRequest>(request).map_err(bad)?)
        }
        WsEndpoint::Completions => prepare_completion(
            engine,
            name,
            serde_json::from_value::<CompletionRequest>(request).map_err(bad)?,
        ),
    }
}

impl WsSession {
    fn on_text(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
        let frame: ClientFrame = match serde_json::from_str(text) {
            Ok(f) => f,
            Err(e) => {
                let id = serde_json::from_str::<Value>(text)
                    .ok()
                    .and_then(|v| v["id"].as_str().map(str::to_string));
                ctx.text(error_frame(id.as_deref(), &ApiError::bad(format!("invalid frame: {e}"), None)));
                return;
            }
        };
        match frame {
            ClientFrame::Generate { id, endpoint, request } => self.generate(id, endpoint, request, ctx),
            ClientFrame::Cancel { id } => self.cancel(&id, ctx),
        }
    }

    fn generate(
        &mut self,
        id: String,
        endpoint: WsEndpoint,
        request: Value,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        if self.running.contains_key(&id) {
            ctx.text(error_frame(
                Some(&id),
                &ApiError::bad(format!("id {id:?} is already running on this socket"), Some("id")),
            ));
            return;
        }
        if self.running.len() >= MAX_CONCURRENT {
            let e =
                ApiError::bad(format!("at most {MAX_CONCURRENT} generations may run on one socket"), None);
            ctx.text(error_frame(Some(&id), &e));
            return;
        }
        self.running.insert(id.clone(), Generation { request_id: None, finish: Vec::new(), reader: None });
        let state = self.state.clone();
        let gid = id.clone();
        let fut = async move {
            let st = state.clone();
            let prepared = web::block(move || prepare(&st, endpoint, request))
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??;
            start(&state, prepared).await
        };
        let fut = fut.into_actor(self).map(move |res, act, ctx| {
            let started = match res {
                Ok(s) => s,
                Err(e) => {
                    act.running.remove(&gid);
                    ctx.text(error_frame(Some(&gid), &e));
                    return;
                }
            };
            // Cancelled while starting: the stream is dropped here, which aborts it.
            let Some(g) = act.running.get_mut(&gid) else { return };
            g.request_id = Some(started.id.clone());
            g.finish = vec![None; started.prepared.prompts.len() * started.prepared.params.n];
            let p = &started.prepared;
            if p.tools.is_some() || p.reasoning.is_some() {
                let tok = act.state.engine.tokenizer().clone();
                g.reader = Some(Shaper::new(started.id.clone(), started.prepared.clone(), tok));
            }
            let model = started.prepared.model.clone();
            ctx.text(
                json!({"type": "started", "id": gid, "request_id": started.id, "model": model}).to_string(),
            );
            let sid = gid.clone();
            let forward =
                started.events.into_actor(act).map(move |ev, act, ctx| act.forward(&sid, ev, ctx)).finish();
            ctx.spawn(forward);
        });
        ctx.spawn(fut);
    }

    fn forward(&mut self, id: &str, ev: GenEvent, ctx: &mut ws::WebsocketContext<Self>) {
        if let Some(r) = self.running.get_mut(id).and_then(|g| g.reader.as_mut())
            && matches!(ev, GenEvent::Token { .. } | GenEvent::Finished { .. })
        {
            r.absorb(ev.clone());
        }
        match ev {
            GenEvent::Token { index, token_id, text, logprobs } => {
                let mut v =
                    json!({"type": "delta", "id": id, "index": index, "text": text, "token_ids": [token_id]});
                if let Some(l) = logprobs {
                    let top: Vec<Value> =
                        l.top.iter().map(|(t, p)| json!({"token_id": t, "logprob": p})).collect();
                    v["logprobs"] =
                        json!({"token_id": l.token_id, "logprob": l.logprob, "top_logprobs": top});
                }
                ctx.text(v.to_string());
            }
            GenEvent::PromptLogprobs { prompt, positions } => {
                let lps = prompt_logprobs_json(self.state.engine.tokenizer(), &positions);
                ctx.text(
                    json!({"type": "prompt_logprobs", "id": id, "prompt": prompt, "prompt_logprobs": lps})
                        .to_string(),
                );
            }
            GenEvent::Finished { index, reason, .. } => {
                if let Some(g) = self.running.get_mut(id)
                    && let Some(f) = g.finish.get_mut(index)
                {
                    *f = Some(reason);
                }
            }
            GenEvent::Done { usage } => {
                let (finish, reader) =
                    self.running.remove(id).map(|g| (g.finish, g.reader)).unwrap_or_default();
                let mut choices: Vec<Value> = finish
                    .iter()
                    .enumerate()
                    .map(|(i, f)| json!({"index": i, "finish_reason": f.map(FinishReason::as_str)}))
                    .collect();
                // Read for tool calls or reasoning: each choice's message as the HTTP
                // response has it (its finish reason `tool_calls` when it called).
                if let Some(r) = reader {
                    let whole = r.response();
                    for (c, w) in choices.iter_mut().zip(whole["choices"].as_array().into_iter().flatten()) {
                        c["message"] = w["message"].clone();
                        c["finish_reason"] = w["finish_reason"].clone();
                    }
                }
                let first = choices.first().map(|c| c["finish_reason"].clone()).unwrap_or(Value::Null);
                ctx.text(
                    json!({"type": "done", "id": id, "finish_reason": first, "choices": choices, "usage": usage})
                        .to_string(),
                );
                self.close_if_cut(ctx);
            }
            GenEvent::Error { message } => {
                self.running.remove(id);
                ctx.text(error_frame(Some(id), &ApiError::Internal(message)));
                self.close_if_cut(ctx);
            }
        }
    }

    /// Aborts a generation in the engine; its stream then ends with `done` / "abort".
    fn cancel(&mut self, id: &str, ctx: &mut ws::WebsocketContext<Self>) {
        let Some(g) = self.running.get(id) else {
            ctx.text(error_frame(
                Some(id),
                &ApiError::NotFound(format!("no running generation with id {id:?}")),
            ));
            return;
        };
        match g.request_id.clone() {
            Some(rid) => {
                let state = self.state.clone();
                let ids = state.live.get(&rid).map(|e| e.value().clone()).unwrap_or_default();
                ctx.spawn(
                    async move {
                        for eid in ids {
                            state.engine.abort(&eid, AbortReason::Cancelled).await;
                        }
                    }
                    .into_actor(self),
                );
            }
            None => {
                // Not started yet: forget it; the start callback drops the stream.
                self.running.remove(id);
                self.state.engine.metrics().on_abort(AbortReason::Cancelled);
                ctx.text(
                    json!({"type": "done", "id": id, "finish_reason": "abort", "choices": [], "usage": null})
                        .to_string(),
                );
            }
        }
    }
}

impl Actor for WsSession {
    type Context = ws::WebsocketContext<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let idle = self.state.timeouts.ws_idle;
        // At the server's cut, close as soon as no generation is left to end.
        let mut phase = self.phase.clone();
        let cut = async move {
            let _ = phase.wait_for(|p| *p == Phase::Cut).await;
        };
        ctx.spawn(cut.into_actor(self).map(|_, act, ctx| act.close_if_cut(ctx)));
        ctx.run_interval(HEARTBEAT.min(idle / 6), move |act, ctx| {
            if act.last_heard.elapsed() > idle {
                tracing::info!(idle_s = idle.as_secs_f64(), "websocket silent too long; closing");
                ctx.close(Some(ws::CloseReason {
                    code: ws::CloseCode::Away,
                    description: Some("no frame within --ws-idle-timeout".into()),
                }));
                ctx.stop();
                return;
            }
            ctx.ping(b"");
        });
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        // Spawned forwarders are dropped with the context, which aborts their requests.
        if !self.running.is_empty() {
            tracing::info!(generations = self.running.len(), "websocket closed; aborting its generations");
        }
    }
}

impl WsSession {
    /// At the server's cut, closes (1001) once no generation is left to end.
    fn close_if_cut(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
        if *self.phase.borrow() == Phase::Cut && self.running.is_empty() {
            self.close(ctx, ws::CloseCode::Away, "the server is shutting down".into());
        }
    }

    /// Ends the session with a close frame of `code`.
    fn close(&mut self, ctx: &mut ws::WebsocketContext<Self>, code: ws::CloseCode, why: String) {
        tracing::info!(code = u16::from(code), "closing websocket: {why}");
        ctx.close(Some(ws::CloseReason { code, description: Some(why) }));
        ctx.stop();
    }

    /// A whole message, joined from its fragments or not.
    fn on_message(&mut self, text: bool, bytes: &[u8], ctx: &mut ws::WebsocketContext<Self>) {
        match (text, std::str::from_utf8(bytes)) {
            (true, Ok(t)) => self.on_text(t, ctx),
            (true, Err(_)) => {
                self.close(ctx, ws::CloseCode::Invalid, "a text message that is not UTF-8".into())
            }
            (false, _) => ctx.text(error_frame(
                None,
                &ApiError::bad("binary frames are not supported; send JSON text", None),
            )),
        }
    }
}

impl StreamHandler<Result<ws::Message, ws::ProtocolError>> for WsSession {
    fn handle(&mut self, msg: Result<ws::Message, ws::ProtocolError>, ctx: &mut Self::Context) {
        self.last_heard = Instant::now();
        if msg.is_ok() {
            self.ledger.handled();
        }
        match msg {
            Ok(ws::Message::Text(t)) => self.on_text(&t, ctx),
            Ok(ws::Message::Binary(b)) => self.on_message(false, &b, ctx),
            Ok(ws::Message::Ping(p)) => ctx.pong(&p),
            Ok(ws::Message::Pong(_)) | Ok(ws::Message::Nop) => {}
            Ok(ws::Message::Close(reason)) => {
                ctx.close(reason);
                ctx.stop();
            }
            // Fragments are joined; FrameGuard has held their announced sizes to MAX_FRAME
            // and their order to the protocol's.
            Ok(ws::Message::Continuation(item)) => match item {
                actix_http::ws::Item::FirstText(b) => self.joining = Some((true, b.to_vec())),
                actix_http::ws::Item::FirstBinary(b) => self.joining = Some((false, b.to_vec())),
                actix_http::ws::Item::Continue(b) => {
                    if let Some((_, buf)) = &mut self.joining {
                        buf.extend_from_slice(&b);
                    }
                }
                actix_http::ws::Item::Last(b) => {
                    if let Some((text, mut buf)) = self.joining.take() {
                        buf.extend_from_slice(&b);
                        self.on_message(text, &buf, ctx);
                    }
                }
            },
            Err(e) => {
                // The decoder's own refusals; a text frame that is not UTF-8 comes as an
                // I/O error naming UTF-8.
                let code = match &e {
                    ws::ProtocolError::Overflow => ws::CloseCode::Size,
                    ws::ProtocolError::Io(io) if io.to_string().to_lowercase().contains("utf-8") => {
                        ws::CloseCode::Invalid
                    }
                    _ => ws::CloseCode::Protocol,
                };
                self.close(ctx, code, format!("websocket protocol error: {e}"));
            }
        }
    }

    /// The input ended: the client closed it, or FrameGuard cut it at a violation.
    fn finished(&mut self, ctx: &mut Self::Context) {
        match self.ledger.violation() {
            Some((code, why)) => self.close(ctx, code, why),
            None => ctx.stop(),
        }
    }
}

pub async fn connect(
    req: HttpRequest,
    stream: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, actix_web::Error> {
    let (guarded, ledger) = FrameGuard::new(stream, MAX_FRAME, MAX_BUFFERED);
    let phase = watch_phase(&state);
    let session = WsSession {
        state,
        last_heard: Instant::now(),
        running: HashMap::new(),
        ledger,
        joining: None,
        phase,
    };
    // The decoder's own limit sits above the guard's, which refuses first with its reason.
    ws::WsResponseBuilder::new(session, &req, guarded).frame_size(MAX_FRAME + 1).start()
}
