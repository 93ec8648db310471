//! Tool calls in a model's output, as vLLM's `--tool-call-parser` reads them, and the
//! grammars that force a call (`tool_choice: "required"` or a named function).
//!
//! - `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
//!   any number, after optional text;
//! - `llama3_json` (Llama 3.1/3.2): the whole output is `{"name": ..., "parameters": {...}}`,
//!   optionally after `<|python_tag|>`, several separated by `;`;
//! - `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`, or (newer
//!   tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call.
//!
//! Output that starts a call and never finishes one comes back as plain content. While
//! streaming, [`ToolStream`] holds back only text that may still turn out to start a
//! call, and sends each call's name once known and its arguments as they grow.

use serde_json::{Value, json};

use super::GuideSpec;

/// vLLM's `--tool-call-parser` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolParser {
    #[value(name = "hermes")]
    Hermes,
    #[value(name = "llama3_json")]
    Llama3Json,
    #[value(name = "mistral")]
    Mistral,
}

/// How a chat request's output is read for tool calls.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// `tool_choice: "auto"`: the parser finds calls in free text.
    Auto(ToolParser),
    /// `tool_choice: "required"`: the output is a JSON list of `{"name", "parameters"}`.
    Required,
    /// A named function: the output is its arguments.
    Named(String),
}

/// One tool call found in the output: its function name and arguments (JSON text).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// The request's functions (`tools[].function`), checked: each has a name and, where
/// given, `parameters` as a JSON schema object.
pub fn functions(tools: &[Value]) -> Result<Vec<(String, Value)>, String> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t["type"] != "function" {
                return Err(format!("tools[{i}].type must be \"function\""));
            }
            let f = &t["function"];
            let name = f["name"].as_str().filter(|n| !n.is_empty());
            let name = name.ok_or_else(|| format!("tools[{i}].function.name is missing"))?;
            let params = match &f["parameters"] {
                Value::Null => json!({"type": "object", "properties": {}}),
                p @ Value::Object(_) => p.clone(),
                _ => return Err(format!("tools[{i}].function.parameters must be a JSON schema object")),
            };
            Ok((name.to_string(), params))
        })
        .collect()
}

/// The grammar of `tool_choice: "required"`: a non-empty list of calls, each naming one of
/// the functions with arguments that follow its parameters (vLLM's shape); one call only
/// unless `parallel` (`parallel_tool_calls`).
pub fn required_spec(functions: &[(String, Value)], parallel: bool) -> GuideSpec {
    let calls: Vec<Value> = functions
        .iter()
        .map(|(name, params)| {
            json!({"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"], "additionalProperties": false})
        })
        .collect();
    let mut list = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
    if !parallel {
        list["maxItems"] = json!(1);
    }
    GuideSpec::JsonSchema(list)
}

/// A call as far as the output goes: its name once complete, its arguments' text so far.
#[derive(Debug, Clone, Default, PartialEq)]
struct PartialCall {
    name: Option<String>,
    arguments: Option<String>,
    /// The call's text is closed.
    done: bool,
}

/// Where tool calls start in `text`.
enum Start {
    /// The calls' text starts at `.1`; the content before them ends at `.0`.
    At(usize, usize),
    /// None yet; from `.0` on the text may still become the start of one.
    Not(usize),
}

impl ToolMode {
    fn start(&self, text: &str) -> Start {
        match self {
            ToolMode::Required | ToolMode::Named(_) => Start::At(0, 0),
            ToolMode::Auto(ToolParser::Hermes) => marker_start(text, "<tool_call>"),
            ToolMode::Auto(ToolParser::Mistral) => marker_start(text, "[TOOL_CALLS]"),
            ToolMode::Auto(ToolParser::Llama3Json) => {
                let lead = text.len() - text.trim_start().len();
                let rest = &text[lead..];
                if let Some(r) = rest.strip_prefix("<|python_tag|>") {
                    return Start::At(0, text.len() - r.len());
                }
                if rest.starts_with('{') {
                    return Start::At(0, lead);
                }
                if rest.is_empty() || "<|python_tag|>".starts_with(rest) {
                    Start::Not(0)
                } else {
                    Start::Not(text.len())
                }
            }
        }
    }

    /// The calls in the text from where they start.
    fn scan(&self, calls: &str) -> Vec<PartialCall> {
        match self {
            ToolMode::Named(name) => {
                let done = !calls.trim().is_empty() && serde_json::from_str::<Value>(calls).is_ok();
                vec![PartialCall { name: Some(name.clone()), arguments: Some(calls.to_string()), done }]
            }
            ToolMode::Auto(ToolParser::Mistral) => {
                let t = calls.trim_start();
                if t.starts_with('[') || t.starts_with('{') || t.is_empty() {
                    scan_objects(calls)
                } else {
                    calls.split("[TOOL_CALLS]").map(scan_named_args).collect()
                }
            }
            _ => scan_objects(calls),
        }
    }

    /// The content and the complete calls of a whole output; an output whose calls do not
    /// parse is all content.
    pub fn parse(&self, text: &str) -> (String, Vec<ToolCall>) {
        let Start::At(content_end, from) = self.start(text) else { return (text.to_string(), Vec::new()) };
        let calls: Vec<ToolCall> = self
            .scan(&text[from..])
            .into_iter()
            .filter(|c| c.done)
            .filter_map(|c| {
                let arguments = c.arguments.unwrap_or_else(|| "{}".into()).trim().to_string();
                serde_json::from_str::<Value>(&arguments).ok()?;
                Some(ToolCall { name: c.name?, arguments })
            })
            .collect();
        if calls.is_empty() {
            return (text.to_string(), Vec::new());
        }
        (text[..content_end].to_string(), calls)
    }

    /// Whether a choice that made calls finishes with `tool_calls` (a named function's
    /// call finishes with `stop`, as OpenAI's does).
    pub fn finishes_with_tool_calls(&self) -> bool {
        !matches!(self, ToolMode::Named(_))
    }
}

fn marker_start(text: &str, marker: &str) -> Start {
    if let Some(at) = text.find(marker) {
        return Start::At(at, at + marker.len());
    }
    // The longest end of the text that begins the marker is held back.
    Start::Not(text.len() - super::marker_prefix_len(text, marker))
}

/// The end of the JSON value starting at `i` (None when the text ends inside it).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let (mut depth, mut j) = (0usize, i);
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let end =
                b[i..].iter().position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\n' | b'\t' | b'\r'));
            end.map(|e| i + e)
        }
    }
}

/// The end of the JSON string starting at `i` (past its closing quote).
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

fn skip_ws(b: &[u8], mut j: usize) -> usize {
    while j < b.len() && b[j].is_ascii_whitespace() {
        j += 1;
    }
    j
}

/// The call objects in `s`, whatever separates them (`[`, `,`, `;`, `</tool_call>`...).
fn scan_objects(s: &str) -> Vec<PartialCall> {
    let b = s.as_bytes();
    let mut calls = Vec::new();
    let mut i = 0;
    while let Some(k) = b[i..].iter().position(|&c| c == b'{') {
        let (call, end) = scan_object(s, i + k);
        calls.push(call);
        match end {
            Some(e) => i = e,
            None => break,
        }
    }
    calls
}

/// One call object at `i`: the call so far and, when closed, the end of its text.
fn scan_object(s: &str, i: usize) -> (PartialCall, Option<usize>) {
    let b = s.as_bytes();
    let mut call = PartialCall::default();
    let mut j = i + 1;
    loop {
        j = skip_ws(b, j);
        match b.get(j) {
            None => return (call, None),
            Some(b'}') => {
                call.done = true;
                return (call, Some(j + 1));
            }
            Some(b',') => {
                j += 1;
                continue;
            }
            Some(b'"') => {}
            Some(_) => return (call, value_end(b, i)),
        }
        let Some(key_end) = string_end(b, j) else { return (call, None) };
        let key: Option<String> = serde_json::from_str(&s[j..key_end]).ok();
        j = skip_ws(b, key_end);
        match b.get(j) {
            None => return (call, None),
            Some(b':') => j = skip_ws(b, j + 1),
            Some(_) => return (call, value_end(b, i)),
        }
        if j >= b.len() {
            return (call, None);
        }
        let end = value_end(b, j);
        match key.as_deref() {
            Some("name") => {
                if let Some(e) = end {
                    call.name = serde_json::from_str(&s[j..e]).ok();
                }
            }
            Some("arguments" | "parameters") => {
                call.arguments = Some(s[j..end.unwrap_or(s.len())].to_string())
            }
            _ => {}
        }
        match end {
            Some(e) => j = e,
            None => return (call, None),
        }
    }
}

/// `name[ARGS]{...}` (Mistral's newer format).
fn scan_named_args(piece: &str) -> PartialCall {
    let Some((name, args)) = piece.split_once("[ARGS]") else { return PartialCall::default() };
    let b = args.as_bytes();
    let start = skip_ws(b, 0);
    let end = value_end(b, start);
    PartialCall {
        name: Some(name.trim().to_string()).filter(|n| !n.is_empty()),
        arguments: Some(args[start..end.unwrap_or(args.len())].to_string()),
        done: end.is_some(),
    }
}

/// What one piece of streamed output adds: content text and tool-call deltas.
#[derive(Debug, Default, PartialEq)]
pub struct StreamDelta {
    pub content: String,
    pub calls: Vec<CallDelta>,
}

/// A delta of call `index`: its id and name the first time, then arguments text.
#[derive(Debug, Clone, PartialEq)]
pub struct CallDelta {
    pub index: usize,
    pub header: Option<(String, String)>,
    pub arguments: String,
}

/// The id of call `index` of a choice whose calls' ids begin with `prefix`, streamed or
/// not.
pub fn call_id(prefix: &str, index: usize) -> String {
    format!("{prefix}-{index}")
}

/// One choice's output read for tool calls while it streams.
pub struct ToolStream {
    mode: ToolMode,
    id_prefix: String,
    text: String,
    content_sent: usize,
    calls_from: Option<usize>,
    /// Per call sent: the arguments' bytes sent.
    sent: Vec<usize>,
}

impl ToolStream {
    /// `id_prefix` makes the calls' ids (`<prefix>-<i>`).
    pub fn new(mode: ToolMode, id_prefix: String) -> Self {
        Self { mode, id_prefix, text: String::new(), content_sent: 0, calls_from: None, sent: Vec::new() }
    }

    pub fn call_id(&self, index: usize) -> String {
        call_id(&self.id_prefix, index)
    }

    /// Whether any call was sent.
    pub fn called(&self) -> bool {
        !self.sent.is_empty()
    }

    pub fn mode(&self) -> &ToolMode {
        &self.mode
    }

    /// Takes the next piece of output text.
    pub fn push(&mut self, piece: &str) -> StreamDelta {
        self.text.push_str(piece);
        let mut out = StreamDelta::default();
        if self.calls_from.is_none() {
            match self.mode.start(&self.text) {
                Start::At(content_end, from) => {
                    out.content =
                        self.text[self.content_sent..content_end.max(self.content_sent)].to_string();
                    self.content_sent = content_end.max(self.content_sent);
                    self.calls_from = Some(from);
                }
                Start::Not(hold) => {
                    if hold > self.content_sent {
                        out.content = self.text[self.content_sent..hold].to_string();
                        self.content_sent = hold;
                    }
                    return out;
                }
            }
        }
        let from = self.calls_from.unwrap_or(0);
        for (index, call) in self.mode.scan(&self.text[from..]).into_iter().enumerate() {
            if index == self.sent.len() {
                let Some(name) = call.name.clone() else { break };
                self.sent.push(0);
                out.calls.push(CallDelta {
                    index,
                    header: Some((self.call_id(index), name)),
                    arguments: String::new(),
                });
            }
            let args = call.arguments.unwrap_or_default();
            // Named arguments stream as they come; others from their first character on.
            let sent = self.sent[index];
            if args.len() > sent {
                let delta = args[sent..].to_string();
                self.sent[index] = args.len();
                match out.calls.last_mut() {
                    Some(last) if last.index == index => last.arguments.push_str(&delta),
                    _ => out.calls.push(CallDelta { index, header: None, arguments: delta }),
                }
            }
        }
        out
    }

    /// The end of the output: text held back and never part of a call comes out as
    /// content.
    pub fn finish(&mut self) -> StreamDelta {
        let mut out = StreamDelta::default();
        if self.sent.is_empty() && self.content_sent < self.text.len() {
            out.content = self.text[self.content_sent..].to_string();
            self.content_sent = self.text.len();
        }
        out
    }
}

#[cfg(test)]
mod tests;
