//! From engine events to what clients read. A request's prompts run as separate engine
//! requests whose streams are merged into one stream of [`GenEvent`]s with global choice
//! indexes (`prompt · n + i`); a [`Shaper`] turns those into OpenAI chunk objects (SSE and
//! WebSocket) or accumulates the non-streaming response, in both endpoints' shapes.

use std::sync::Arc;

use futures::stream::{self, SelectAll, Stream, StreamExt};
use serde_json::{Value, json};

use super::protocol::{Endpoint, Prepared};
use crate::engine::RequestStream;
use crate::request::{FinishReason, PromptLogprob, StopReason, TokenEvent, TokenLogprobs, Usage};
use crate::structured::reasoning::ReasoningStream;
use crate::structured::tools::{self, StreamDelta, ToolCall, ToolMode, ToolStream};
use crate::tokenizer::Tokenizer;

/// One event of a whole (possibly multi-prompt) request.
#[derive(Debug, Clone)]
pub enum GenEvent {
    Token {
        index: usize,
        token_id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        index: usize,
        reason: FinishReason,
        stop_reason: Option<StopReason>,
    },
    /// The logprobs of prompt `prompt` (`prompt_logprobs`), before its first token.
    PromptLogprobs {
        prompt: usize,
        positions: Arc<Vec<Option<PromptLogprob>>>,
    },
    /// Every engine request ended; usage summed over prompts.
    Done {
        usage: Usage,
    },
    Error {
        message: String,
    },
}

type Tagged = stream::Map<RequestStream, Box<dyn FnMut(TokenEvent) -> (usize, TokenEvent)>>;

/// Merges the engine streams of a request's prompts (`n` choices each).
pub fn merge(streams: Vec<RequestStream>, n: usize) -> impl Stream<Item = GenEvent> {
    let remaining = streams.len();
    let all: SelectAll<Tagged> = stream::select_all(streams.into_iter().enumerate().map(|(p, s)| {
        let tag: Box<dyn FnMut(TokenEvent) -> (usize, TokenEvent)> = Box::new(move |e| (p, e));
        s.map(tag)
    }));
    stream::unfold(
        (all, remaining, Usage::default(), false),
        move |(mut all, mut left, mut usage, done)| async move {
            if done {
                return None;
            }
            loop {
                let Some((p, ev)) = all.next().await else {
                    return Some((
                        GenEvent::Error { message: "the engine stopped".into() },
                        (all, 0, usage, true),
                    ));
                };
                let out = match ev {
                    TokenEvent::Token { index, token_id, text, logprobs } => {
                        GenEvent::Token { index: p * n + index, token_id, text, logprobs }
                    }
                    TokenEvent::Finished { index, reason, stop_reason } => {
                        GenEvent::Finished { index: p * n + index, reason, stop_reason }
                    }
                    TokenEvent::PromptLogprobs { positions } => {
                        GenEvent::PromptLogprobs { prompt: p, positions: Arc::new(positions) }
                    }
                    TokenEvent::Error { message } => {
                        return Some((GenEvent::Error { message }, (all, 0, usage, true)));
                    }
                    TokenEvent::Done { usage: u } => {
                        usage.prompt_tokens += u.prompt_tokens;
                        usage.completion_tokens += u.completion_tokens;
                        usage.total_tokens += u.total_tokens;
                        usage.cached_tokens += u.cached_tokens;
                        left -= 1;
                        if left > 0 {
                            continue;
                        }
                        return Some((GenEvent::Done { usage }, (all, 0, usage, true)));
                    }
                };
                return Some((out, (all, left, usage, false)));
            }
        },
    )
}

/// The ids of a choice's tool calls begin with this (`call-<response id>-<choice>`).
fn call_id_prefix(id: &str, choice: usize) -> String {
    format!("call-{id}-{choice}")
}

fn stop_reason_json(s: &Option<StopReason>) -> Value {
    match s {
        Some(StopReason::Token(t)) => json!(t),
        Some(StopReason::Text(t)) => json!(t),
        Some(StopReason::Eos) | None => Value::Null,
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
}

/// vLLM's `prompt_logprobs`: per prompt position null (the first) or an object of token
/// ids, the prompt's token and the top ones, each with its logprob, rank and text.
pub fn prompt_logprobs_json(tok: &Tokenizer, positions: &[Option<PromptLogprob>]) -> Value {
    let entry = |id: u32, logprob: f32, rank: usize| json!({"logprob": logprob, "rank": rank, "decoded_token": tok.id_to_token(id)});
    positions
        .iter()
        .map(|p| {
            let Some(p) = p else { return Value::Null };
            let mut m = serde_json::Map::new();
            m.insert(p.token_id.to_string(), entry(p.token_id, p.logprob, p.rank));
            for (r, &(id, lp)) in p.top.iter().enumerate() {
                m.entry(id.to_string()).or_insert_with(|| entry(id, lp, r + 1));
            }
            Value::Object(m)
        })
        .collect()
}

/// Per-choice state for the non-streaming response.
#[derive(Default, Clone)]
struct ChoiceAcc {
    text: String,
    finish: Option<FinishReason>,
    stop: Option<StopReason>,
    logprobs: Vec<TokenLogprobs>,
}

/// One chat choice's output read while it streams: the reasoning split off, then tool
/// calls found in the answer.
struct ChoiceReader {
    reasoning: Option<ReasoningStream>,
    tools: Option<ToolStream>,
}

/// What a piece of a chat choice's output adds to each part of the message.
#[derive(Default)]
struct MessageDelta {
    reasoning: String,
    tools: StreamDelta,
}

impl MessageDelta {
    fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.tools.content.is_empty() && self.tools.calls.is_empty()
    }
}

impl ChoiceReader {
    fn push(&mut self, text: &str) -> MessageDelta {
        let (reasoning, answer) = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => (String::new(), text.to_string()),
        };
        MessageDelta { reasoning, tools: self.read_answer(&answer) }
    }

    fn read_answer(&mut self, answer: &str) -> StreamDelta {
        match &mut self.tools {
            Some(t) => t.push(answer),
            None => StreamDelta { content: answer.to_string(), calls: Vec::new() },
        }
    }

    fn finish(&mut self) -> MessageDelta {
        let (reasoning, answer) = match &mut self.reasoning {
            Some(r) => r.finish(),
            None => (String::new(), String::new()),
        };
        let mut tools = self.read_answer(&answer);
        if let Some(t) = &mut self.tools {
            let rest = t.finish();
            tools.content.push_str(&rest.content);
            tools.calls.extend(rest.calls);
        }
        MessageDelta { reasoning, tools }
    }

    /// The finish reason a client sees: `tool_calls` when the choice called tools.
    fn finish_reason(&self, reason: FinishReason) -> &'static str {
        match &self.tools {
            Some(t) if reason == FinishReason::Stop && t.called() && t.mode().finishes_with_tool_calls() => {
                "tool_calls"
            }
            _ => reason.as_str(),
        }
    }
}

fn delta_json(d: &MessageDelta) -> Value {
    let mut delta = serde_json::Map::new();
    if !d.reasoning.is_empty() {
        delta.insert("reasoning_content".into(), json!(d.reasoning));
    }
    if !d.tools.content.is_empty() {
        delta.insert("content".into(), json!(d.tools.content));
    }
    if !d.tools.calls.is_empty() {
        let calls: Vec<Value> = d
            .tools
            .calls
            .iter()
            .map(|c| match &c.header {
                Some((id, name)) => json!({"index": c.index, "id": id, "type": "function",
                    "function": {"name": name, "arguments": c.arguments}}),
                None => json!({"index": c.index, "function": {"arguments": c.arguments}}),
            })
            .collect();
        delta.insert("tool_calls".into(), json!(calls));
    }
    Value::Object(delta)
}

fn tool_calls_json(calls: &[ToolCall], id: impl Fn(usize) -> String) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| json!({"id": id(k), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect()
}

/// Shapes events into one endpoint's response objects.
pub struct Shaper {
    pub id: String,
    pub created: u64,
    prepared: Arc<Prepared>,
    tok: Arc<Tokenizer>,
    usage: Usage,
    text_offsets: Vec<usize>,
    started: Vec<bool>,
    choices: Vec<ChoiceAcc>,
    /// Per chat choice, when its output is read for reasoning or tool calls.
    readers: Vec<Option<ChoiceReader>>,
    /// Per prompt, its `prompt_logprobs` in the response's shape once they came.
    prompt_logprobs: Vec<Value>,
}

impl Shaper {
    pub fn new(id: String, prepared: Arc<Prepared>, tok: Arc<Tokenizer>) -> Self {
        let total = prepared.prompts.len() * prepared.params.n;
        let created =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let usage = Usage {
            prompt_tokens: prepared.prompts.iter().map(Vec::len).sum::<usize>(),
            ..Default::default()
        };
        let reads =
            prepared.endpoint == Endpoint::Chat && (prepared.tools.is_some() || prepared.reasoning.is_some());
        let readers = (0..total)
            .map(|i| {
                reads.then(|| ChoiceReader {
                    reasoning: prepared.reasoning.map(ReasoningStream::new),
                    tools: prepared.tools.clone().map(|m| ToolStream::new(m, call_id_prefix(&id, i))),
                })
            })
            .collect();
        let prompt_logprobs = vec![Value::Null; prepared.prompts.len()];
        Self {
            id,
            created,
            prepared,
            tok,
            usage,
            text_offsets: vec![0; total],
            started: vec![false; total],
            choices: vec![ChoiceAcc::default(); total],
            readers,
            prompt_logprobs,
        }
    }

    fn n(&self) -> usize {
        self.prepared.params.n
    }

    fn echo_for(&self, index: usize) -> Option<&str> {
        self.prepared.echo.get(index / self.n()).and_then(|e| e.as_deref())
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.prepared.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
        }
    }

    fn envelope(&self, choices: Vec<Value>, usage: Option<&Usage>) -> Value {
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.prepared.model, "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = usage_json(u);
        }
        v
    }

    fn token_text(&self, id: u32) -> String {
        self.tok.id_to_token(id)
    }

    /// Logprobs of one token in the endpoint's shape.
    fn logprobs_json(&self, lps: &[TokenLogprobs], first_offset: usize) -> Value {
        match self.prepared.endpoint {
            Endpoint::Completions => {
                let mut offset = first_offset;
                let (mut tokens, mut lp, mut top, mut offsets) = (vec![], vec![], vec![], vec![]);
                for l in lps {
                    let t = self.token_text(l.token_id);
                    offsets.push(offset);
                    offset += t.len();
                    tokens.push(t);
                    lp.push(l.logprob);
                    let m: serde_json::Map<String, Value> =
                        l.top.iter().map(|(id, p)| (self.token_text(*id), json!(p))).collect();
                    top.push(Value::Object(m));
                }
                json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": top, "text_offset": offsets})
            }
            Endpoint::Chat => {
                let entry = |id: u32, p: f32| {
                    let t = self.token_text(id);
                    json!({"token": t, "logprob": p, "bytes": t.as_bytes()})
                };
                let content: Vec<Value> = lps
                    .iter()
                    .map(|l| {
                        let mut e = entry(l.token_id, l.logprob);
                        e["top_logprobs"] = l.top.iter().map(|(id, p)| entry(*id, *p)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
        }
    }

    /// Chunks that open the stream (the chat role delta of every choice).
    pub fn opening_chunks(&mut self) -> Vec<Value> {
        if self.prepared.endpoint != Endpoint::Chat {
            return Vec::new();
        }
        let choices = (0..self.choices.len())
            .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
            .collect();
        vec![self.envelope(choices, None)]
    }

    fn continuous_usage(&self) -> Option<Usage> {
        self.prepared.stream_options.continuous_usage_stats.then_some(Usage {
            total_tokens: self.usage.prompt_tokens + self.usage.completion_tokens,
            ..self.usage
        })
    }

    /// The chunks an event produces while streaming (empty when nothing is visible yet).
    pub fn chunks(&mut self, ev: &GenEvent) -> Vec<Value> {
        match ev {
            GenEvent::Token { index, text, logprobs, .. } => {
                self.usage.completion_tokens += 1;
                let i = *index;
                let mut echo = String::new();
                if !self.started[i] {
                    self.started[i] = true;
                    if let Some(e) = self.echo_for(i) {
                        echo = e.to_string();
                    }
                }
                let read = self.readers[i].as_mut().map(|r| {
                    let mut d = r.push(text);
                    d.tools.content.insert_str(0, &echo);
                    d
                });
                let text = format!("{echo}{text}");
                if read.as_ref().map_or(text.is_empty(), MessageDelta::is_empty) && logprobs.is_none() {
                    return Vec::new();
                }
                let lp = logprobs
                    .as_ref()
                    .map(|l| self.logprobs_json(std::slice::from_ref(l), self.text_offsets[i]));
                self.text_offsets[i] += text.len();
                let choice = match (self.prepared.endpoint, read) {
                    (Endpoint::Completions, _) => {
                        json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null, "stop_reason": null})
                    }
                    (Endpoint::Chat, Some(d)) => {
                        json!({"index": i, "delta": delta_json(&d), "logprobs": lp, "finish_reason": null})
                    }
                    (Endpoint::Chat, None) => {
                        json!({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
                    }
                };
                let usage = self.continuous_usage();
                vec![self.envelope(vec![choice], usage.as_ref())]
            }
            GenEvent::Finished { index, reason, stop_reason } => {
                let mut out = Vec::new();
                let mut finish = reason.as_str();
                if let Some(r) = self.readers[*index].as_mut() {
                    let rest = r.finish();
                    finish = r.finish_reason(*reason);
                    if !rest.is_empty() {
                        let choice = json!({"index": index, "delta": delta_json(&rest), "logprobs": null, "finish_reason": null});
                        out.push(self.envelope(vec![choice], None));
                    }
                }
                let choice = match self.prepared.endpoint {
                    Endpoint::Completions => json!({"index": index, "text": "", "logprobs": null,
                        "finish_reason": finish, "stop_reason": stop_reason_json(stop_reason)}),
                    Endpoint::Chat => json!({"index": index, "delta": {}, "logprobs": null,
                        "finish_reason": finish, "stop_reason": stop_reason_json(stop_reason)}),
                };
                let usage = self.continuous_usage();
                out.push(self.envelope(vec![choice], usage.as_ref()));
                out
            }
            GenEvent::PromptLogprobs { prompt, positions } => {
                let lps = prompt_logprobs_json(&self.tok, positions);
                match self.prepared.endpoint {
                    // Every choice of the prompt carries them, as in the whole response.
                    Endpoint::Completions => {
                        let choices = (prompt * self.n()..(prompt + 1) * self.n())
                            .map(|i| {
                                json!({"index": i, "text": "", "logprobs": null, "finish_reason": null,
                                "stop_reason": null, "prompt_logprobs": lps})
                            })
                            .collect();
                        vec![self.envelope(choices, None)]
                    }
                    Endpoint::Chat => {
                        let mut chunk = self.envelope(Vec::new(), None);
                        chunk["prompt_logprobs"] = lps;
                        vec![chunk]
                    }
                }
            }
            GenEvent::Done { usage } => {
                self.usage = *usage;
                if self.prepared.stream_options.include_usage {
                    vec![self.envelope(Vec::new(), Some(usage))]
                } else {
                    Vec::new()
                }
            }
            GenEvent::Error { .. } => Vec::new(),
        }
    }

    /// Accumulates an event for the non-streaming response.
    pub fn absorb(&mut self, ev: GenEvent) {
        match ev {
            GenEvent::Token { index, text, logprobs, .. } => {
                let c = &mut self.choices[index];
                c.text.push_str(&text);
                c.logprobs.extend(logprobs);
            }
            GenEvent::Finished { index, reason, stop_reason } => {
                self.choices[index].finish = Some(reason);
                self.choices[index].stop = stop_reason;
            }
            GenEvent::PromptLogprobs { prompt, positions } => {
                if let Some(slot) = self.prompt_logprobs.get_mut(prompt) {
                    *slot = prompt_logprobs_json(&self.tok, &positions);
                }
            }
            GenEvent::Done { usage } => self.usage = usage,
            GenEvent::Error { .. } => {}
        }
    }

    /// A whole chat choice's message, its reasoning and tool calls read out where the
    /// request asks, and its finish reason.
    fn message(&self, i: usize, echo: &str, c: &ChoiceAcc) -> (Value, Option<&'static str>) {
        let p = &self.prepared;
        let finish = c.finish.map(FinishReason::as_str);
        if self.readers[i].is_none() {
            return (json!({"role": "assistant", "content": format!("{echo}{}", c.text)}), finish);
        }
        let (reasoning, answer) = match p.reasoning {
            Some(r) => r.split(&c.text),
            None => (None, c.text.clone()),
        };
        let (content, calls) = match &p.tools {
            Some(mode) => mode.parse(&answer),
            None => (answer, Vec::new()),
        };
        let content = format!("{echo}{content}");
        let mut m = json!({"role": "assistant", "content": content});
        if p.reasoning.is_some() {
            m["reasoning_content"] = json!(reasoning);
        }
        let mut finish = finish;
        if !calls.is_empty() {
            let prefix = call_id_prefix(&self.id, i);
            m["tool_calls"] = tool_calls_json(&calls, |k| tools::call_id(&prefix, k));
            if content.trim().is_empty() {
                m["content"] = Value::Null;
            }
            if c.finish == Some(FinishReason::Stop)
                && p.tools.as_ref().is_some_and(ToolMode::finishes_with_tool_calls)
            {
                finish = Some("tool_calls");
            }
        }
        (m, finish)
    }

    /// The whole non-streaming response.
    pub fn response(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let echo = self.echo_for(i).unwrap_or("");
                let lp = (self.prepared.params.logprobs.is_some()).then(|| self.logprobs_json(&c.logprobs, echo.len()));
                let finish = c.finish.map(FinishReason::as_str);
                let stop = stop_reason_json(&c.stop);
                match self.prepared.endpoint {
                    Endpoint::Completions => json!({"index": i, "text": format!("{echo}{}", c.text), "logprobs": lp,
                        "finish_reason": finish, "stop_reason": stop, "prompt_logprobs": self.prompt_logprobs[i / self.n()]}),
                    Endpoint::Chat => {
                        let (message, finish) = self.message(i, echo, c);
                        json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish, "stop_reason": stop})
                    }
                }
            })
            .collect();
        let mut v = json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.prepared.model,
            "choices": choices, "usage": usage_json(&self.usage),
        });
        // Chat has one prompt: its prompt logprobs sit beside the choices (vLLM's shape).
        if self.prepared.endpoint == Endpoint::Chat {
            v["prompt_logprobs"] = self.prompt_logprobs[0].clone();
        }
        v
    }
}
