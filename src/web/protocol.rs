//! OpenAI request bodies with vLLM's extra fields, validated at the edge into a
//! [`Prepared`] request: prompt token ids per prompt, checked [`SamplingParams`] and the
//! response options. Only prepared requests go inward, over HTTP and WebSocket alike.

use serde::Deserialize;

use serde_json::Value;

use super::errors::ApiError;
use crate::engine::Engine;
use crate::request::{BeamParams, EarlyStopping, MAX_LOGPROBS, SamplingDefaults, SamplingParams};
use crate::structured::GuideSpec;
use crate::structured::reasoning::ReasoningParser;
use crate::structured::tools::{self, ToolMode};
use crate::tokenizer::{ChatMessage, ChatTemplateOptions};

/// Prompts in every shape `/v1/completions` accepts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// Structured output and tool fields: OpenAI's `response_format`, `tools` and
/// `tool_choice`, vLLM's `guided_*` fields and its newer `structured_outputs` object.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredFields {
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub structured_outputs: Option<Value>,
}

/// What a request's structured fields ask of its output.
#[derive(Debug, Default)]
pub struct OutputRules {
    /// The grammar the output follows, with the field that asked for it.
    pub guide: Option<(GuideSpec, &'static str)>,
    /// How the output is read for tool calls.
    pub tools: Option<ToolMode>,
    /// The tools the chat template is given.
    pub template_tools: Option<Vec<Value>>,
}

/// The parser of `tool_choice: "auto"`, which needs the server's flags (vLLM's message).
fn auto_parser(engine: &Engine) -> Result<tools::ToolParser, ApiError> {
    engine.config().auto_tool_parser.ok_or_else(|| {
        ApiError::bad(
            "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
            Some("tool_choice"),
        )
    })
}

/// A JSON schema given inline or as JSON text.
fn schema_value(v: &Value, field: &'static str) -> Result<GuideSpec, ApiError> {
    match v {
        Value::String(text) => serde_json::from_str(text)
            .map(GuideSpec::JsonSchema)
            .map_err(|e| ApiError::bad(format!("{field} is not valid JSON: {e}"), Some(field))),
        v => Ok(GuideSpec::JsonSchema(v.clone())),
    }
}

impl StructuredFields {
    /// The grammar of `response_format`, a `guided_*` field or `structured_outputs`; at
    /// most one of them may be set.
    fn guide(&self) -> Result<Option<(GuideSpec, &'static str)>, ApiError> {
        let mut found: Vec<(GuideSpec, &'static str)> = Vec::new();
        if let Some(f) = self.response_format.as_ref().filter(|f| !f.is_null()) {
            let field = "response_format";
            match f["type"].as_str() {
                Some("text") => {}
                Some("json_object") => found.push((GuideSpec::JsonObject, field)),
                Some("json_schema") => {
                    // `strict` or not, the schema is enforced.
                    let schema = &f["json_schema"]["schema"];
                    if schema.is_null() {
                        return Err(ApiError::bad(
                            "response_format.json_schema.schema is missing",
                            Some(field),
                        ));
                    }
                    found.push((schema_value(schema, field)?, field));
                }
                other => {
                    return Err(ApiError::bad(
                        format!(
                            "response_format.type must be text, json_object or json_schema, got {other:?}"
                        ),
                        Some(field),
                    ));
                }
            }
        }
        if let Some(v) = self.guided_json.as_ref().filter(|v| !v.is_null()) {
            found.push((schema_value(v, "guided_json")?, "guided_json"));
        }
        if let Some(rx) = &self.guided_regex {
            found.push((GuideSpec::Regex(rx.clone()), "guided_regex"));
        }
        if let Some(c) = &self.guided_choice {
            found.push((GuideSpec::Choice(c.clone()), "guided_choice"));
        }
        if let Some(g) = &self.guided_grammar {
            found.push((GuideSpec::Grammar(g.clone()), "guided_grammar"));
        }
        if let Some(so) = self.structured_outputs.as_ref().filter(|v| !v.is_null()) {
            let field = "structured_outputs";
            let text = |key: &str| so[key].as_str().map(str::to_string);
            let spec = if !so["json"].is_null() {
                schema_value(&so["json"], field)?
            } else if let Some(rx) = text("regex") {
                GuideSpec::Regex(rx)
            } else if let Some(choices) = so["choice"].as_array() {
                let c: Option<Vec<String>> = choices.iter().map(|c| c.as_str().map(str::to_string)).collect();
                GuideSpec::Choice(
                    c.ok_or_else(|| ApiError::bad("structured_outputs.choice must be strings", Some(field)))?,
                )
            } else if let Some(g) = text("grammar") {
                GuideSpec::Grammar(g)
            } else if so["json_object"] == true {
                GuideSpec::JsonObject
            } else {
                return Err(ApiError::bad(
                    "structured_outputs must set one of json, regex, choice, grammar or json_object",
                    Some(field),
                ));
            };
            found.push((spec, field));
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|f| f.1).collect();
            return Err(ApiError::bad(
                format!("only one kind of structured output may be asked for, got {}", names.join(" and ")),
                Some(names[1]),
            ));
        }
        Ok(found.pop())
    }

    /// The request's output rules; `chat` is false on the completions endpoint, which takes
    /// no tools.
    pub fn rules(&self, engine: &Engine, chat: bool) -> Result<OutputRules, ApiError> {
        let mut rules = OutputRules { guide: self.guide()?, ..Default::default() };
        let tools = self.tools.as_deref().unwrap_or_default();
        let choice = self.tool_choice.as_ref().filter(|c| !c.is_null());
        if tools.is_empty() {
            if choice.is_some_and(|c| c != "none" && c != "auto") {
                return Err(ApiError::bad(
                    "tool_choice names a tool but the request gives no tools",
                    Some("tool_choice"),
                ));
            }
            return Ok(rules);
        }
        if !chat {
            return Err(ApiError::bad("tools are taken by /v1/chat/completions only", Some("tools")));
        }
        let functions = tools::functions(tools).map_err(|e| ApiError::bad(e, Some("tools")))?;
        rules.template_tools = Some(tools.to_vec());
        let forced = match choice {
            None => {
                rules.tools = Some(ToolMode::Auto(auto_parser(engine)?));
                None
            }
            Some(c) if c == "auto" => {
                rules.tools = Some(ToolMode::Auto(auto_parser(engine)?));
                None
            }
            Some(c) if c == "none" => None,
            Some(c) if c == "required" => {
                let parallel = self.parallel_tool_calls.unwrap_or(true);
                Some((ToolMode::Required, tools::required_spec(&functions, parallel)))
            }
            Some(c) => {
                let name = c["function"]["name"].as_str().filter(|_| c["type"] == "function").ok_or_else(|| {
                    ApiError::bad(
                        "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        Some("tool_choice"),
                    )
                })?;
                let (_, params) = functions.iter().find(|(n, _)| n == name).ok_or_else(|| {
                    ApiError::bad(
                        format!("tool_choice names {name:?}, which is not among the tools"),
                        Some("tool_choice"),
                    )
                })?;
                Some((ToolMode::Named(name.to_string()), GuideSpec::JsonSchema(params.clone())))
            }
        };
        if let Some((mode, spec)) = forced {
            if let Some((_, field)) = &rules.guide {
                return Err(ApiError::bad(
                    format!("{field} cannot be combined with a tool_choice that forces a call"),
                    Some(field),
                ));
            }
            rules.tools = Some(mode);
            rules.guide = Some((spec, "tool_choice"));
        }
        Ok(rules)
    }
}

/// vLLM's request fields that change the output and that this server does not implement
/// yet: a request that sets one (to other than its default) gets a 400 naming it, never
/// output that silently ignored it. Fields that do not change the output (`user`,
/// `metadata`, `store`, `service_tier`, ...) are accepted and ignored.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UnimplementedFields {
    truncate_prompt_tokens: Option<serde_json::Value>,
    logits_processors: Option<serde_json::Value>,
    return_tokens_as_token_ids: Option<serde_json::Value>,
    documents: Option<serde_json::Value>,
}

impl UnimplementedFields {
    fn check(&self) -> Result<(), ApiError> {
        use serde_json::Value;
        // Each field with the value that leaves the output as this server makes it.
        let default_is =
            |v: &Option<Value>, default: &Value| v.as_ref().is_none_or(|v| v.is_null() || v == default);
        let empty = |v: &Option<Value>| {
            v.as_ref().is_none_or(|v| {
                v.is_null()
                    || v.as_array().is_some_and(Vec::is_empty)
                    || v.as_object().is_some_and(|o| o.is_empty())
            })
        };
        let f = Value::Bool(false);
        let fields: [(&'static str, bool); 4] = [
            ("truncate_prompt_tokens", empty(&self.truncate_prompt_tokens)),
            ("logits_processors", empty(&self.logits_processors)),
            ("return_tokens_as_token_ids", default_is(&self.return_tokens_as_token_ids, &f)),
            ("documents", empty(&self.documents)),
        ];
        match fields.iter().find(|(_, default)| !default) {
            Some((name, _)) => Err(ApiError::bad(
                format!(
                    "{name} is not supported by this server yet: the request would not be served as asked"
                ),
                Some(name),
            )),
            None => Ok(()),
        }
    }
}

/// The roles a chat message may have.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// Sampling fields shared by both endpoints (vLLM's names).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub n: Option<usize>,
    pub best_of: Option<usize>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub min_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopInput>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    pub allowed_token_ids: Option<Vec<u32>>,
    pub bad_words: Option<Vec<String>>,
    /// Top logprobs per prompt position (vLLM's `prompt_logprobs`).
    pub prompt_logprobs: Option<i64>,
    /// vLLM's request priority (`--scheduling-policy priority`; lower goes first).
    pub priority: Option<i64>,
    /// vLLM's beam search fields: `n` results of `best_of` (else `n`) beams.
    pub use_beam_search: Option<bool>,
    pub length_penalty: Option<f32>,
    /// `true`, `false` or `"never"`, as transformers and vLLM take it.
    pub early_stopping: Option<serde_json::Value>,
}

/// LLaMA-Factory's / vLLM's LoRARequest(lora_name, lora_int_id, lora_path): the adapter is
/// chosen by name; it must be registered (at start or through /v1/load_lora_adapter).
#[derive(Debug, Clone, Deserialize)]
pub struct LoraRequestIn {
    pub lora_name: String,
    #[serde(default)]
    pub lora_int_id: Option<u64>,
    #[serde(default)]
    pub lora_path: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub lora_request: Option<LoraRequestIn>,
    pub prompt: PromptInput,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default)]
    pub echo: bool,
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub structured: StructuredFields,
    #[serde(flatten)]
    pub unimplemented: UnimplementedFields,
}

/// Message content: a string or a list of parts (only text parts are accepted).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MessageIn {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant turn's calls (`arguments` as JSON text, as OpenAI sends them).
    pub tool_calls: Option<Vec<Value>>,
    /// A tool turn's answer to this call.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub lora_request: Option<LoraRequestIn>,
    pub messages: Vec<MessageIn>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(flatten)]
    pub template: TemplateFields,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub structured: StructuredFields,
    #[serde(flatten)]
    pub unimplemented: UnimplementedFields,
}

/// How a chat request's messages become its prompt (vLLM's fields, HF's keywords).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TemplateFields {
    pub add_generation_prompt: Option<bool>,
    /// End the prompt inside the last message, so that the answer continues it.
    #[serde(default)]
    pub continue_final_message: bool,
    /// A Jinja chat template to use instead of the model's.
    pub chat_template: Option<String>,
    /// Extra variables for the chat template (`{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

impl TemplateFields {
    /// The rendering options; as vLLM, a continued final message takes no generation
    /// prompt unless one is asked for.
    pub fn options(&self) -> ChatTemplateOptions<'_> {
        ChatTemplateOptions {
            add_generation_prompt: self.add_generation_prompt.unwrap_or(!self.continue_final_message),
            continue_final_message: self.continue_final_message,
            template: self.chat_template.as_deref(),
            kwargs: self.chat_template_kwargs.as_ref(),
            tools: None,
        }
    }
}

/// Which response shape a request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A request validated at the edge, ready for the engine.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub endpoint: Endpoint,
    /// The name responses carry: a served model name or the adapter's.
    pub model: String,
    /// The adapter to run with (None = the base model).
    pub lora: Option<String>,
    /// Token ids of each prompt (one per choice group).
    pub prompts: Vec<Vec<u32>>,
    /// Text echoed before the output (completions `echo`, chat `echo` of the last message).
    pub echo: Vec<Option<String>>,
    pub params: SamplingParams,
    pub stream: bool,
    pub stream_options: StreamOptions,
    /// How a chat output is read for tool calls.
    pub tools: Option<ToolMode>,
    /// How a chat output's reasoning is split off (`--reasoning-parser`).
    pub reasoning: Option<ReasoningParser>,
}

/// A count of top logprobs a request asks for, 0 to `max` (`--max-logprobs`, at most
/// [`MAX_LOGPROBS`]); vLLM's -1 (the whole vocabulary) is refused by name.
fn logprob_count(v: i64, field: &'static str, max: usize) -> Result<usize, ApiError> {
    match v {
        -1 => Err(ApiError::bad(
            format!("{field} -1 (every token of the vocabulary) is not supported: ask for 0 to {max}"),
            Some(field),
        )),
        v if (0..=max as i64).contains(&v) => Ok(v as usize),
        _ if max < MAX_LOGPROBS => Err(ApiError::bad(
            format!("{field} must be between 0 and {max} (this server's --max-logprobs), got {v}"),
            Some(field),
        )),
        _ => Err(ApiError::bad(format!("{field} must be between 0 and {max}, got {v}"), Some(field))),
    }
}

fn check_n(f: &SamplingFields) -> Result<usize, ApiError> {
    let n = f.n.unwrap_or(1);
    if let Some(b) = f.best_of
        && b != n
        && f.use_beam_search != Some(true)
    {
        return Err(ApiError::bad(
            format!("best_of must equal n ({n}), got {b}, unless use_beam_search is true"),
            Some("best_of"),
        ));
    }
    Ok(n)
}

/// The beam search a request asks for (`use_beam_search`), if any.
fn beam(f: &SamplingFields, n: usize) -> Result<Option<BeamParams>, ApiError> {
    let early_stopping = match &f.early_stopping {
        None | Some(Value::Null) | Some(Value::Bool(false)) => EarlyStopping::Heuristic,
        Some(Value::Bool(true)) => EarlyStopping::Done,
        Some(Value::String(s)) if s == "never" => EarlyStopping::Never,
        Some(v) => {
            return Err(ApiError::bad(
                format!("early_stopping must be true, false or \"never\", got {v}"),
                Some("early_stopping"),
            ));
        }
    };
    if f.use_beam_search != Some(true) {
        let set = [
            ("length_penalty", f.length_penalty.is_some_and(|l| l != 1.0)),
            ("early_stopping", early_stopping != EarlyStopping::Heuristic),
        ];
        if let Some((name, _)) = set.iter().find(|(_, s)| *s) {
            return Err(ApiError::bad(format!("{name} needs use_beam_search"), Some(name)));
        }
        return Ok(None);
    }
    Ok(Some(BeamParams {
        width: f.best_of.unwrap_or(n),
        length_penalty: f.length_penalty.unwrap_or(1.0),
        early_stopping,
    }))
}

/// Beam search answers whole, once the search ends: a streamed one is refused, as vLLM
/// refuses it (the WebSocket, which always streams, gets the whole answer at the end).
fn check_beam(params: &SamplingParams, stream: bool) -> Result<(), ApiError> {
    if params.beam.is_some() && stream {
        return Err(ApiError::bad("use_beam_search does not stream: set stream to false", Some("stream")));
    }
    Ok(())
}

/// OpenAI's `logit_bias` (`{"<token id>": bias}`) as (token, bias) pairs.
fn logit_bias(f: &SamplingFields) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad(m, Some("logit_bias"));
    let Some(map) = &f.logit_bias else { return Ok(Vec::new()) };
    map.iter()
        .map(|(k, v)| {
            let t = k.parse::<u32>().map_err(|_| bad(format!("logit_bias keys are token ids, got {k:?}")))?;
            let b =
                v.as_f64().ok_or_else(|| bad(format!("logit_bias values are numbers, got {v} for {k}")))?;
            Ok((t, b as f32))
        })
        .collect()
}

/// The sampling fields that name tokens, checked against the model's vocabulary, and
/// `bad_words` tokenized as vLLM does it: each word alone and after a space (when that
/// gives another sequence of the same length).
fn token_fields(params: &mut SamplingParams, f: &SamplingFields, engine: &Engine) -> Result<(), ApiError> {
    let max = engine.config().max_logprobs;
    params.prompt_logprobs =
        f.prompt_logprobs.map(|l| logprob_count(l, "prompt_logprobs", max)).transpose()?;
    if params.priority != 0 && engine.config().scheduling_policy != crate::config::SchedulingPolicy::Priority
    {
        return Err(ApiError::bad(
            format!("priority {} needs a server started with --scheduling-policy priority", params.priority),
            Some("priority"),
        ));
    }
    let vocab = engine.model_config().vocab_size;
    let check = |t: u32, field: &'static str| {
        if (t as usize) < vocab {
            Ok(())
        } else {
            Err(ApiError::bad(
                format!("{field}: token id {t} is out of vocabulary (size {vocab})"),
                Some(field),
            ))
        }
    };
    for &(t, _) in &params.logit_bias {
        check(t, "logit_bias")?;
    }
    for &t in params.allowed_token_ids.iter().flatten() {
        check(t, "allowed_token_ids")?;
    }
    let tok = engine.tokenizer();
    for word in f.bad_words.iter().flatten() {
        let word = word.trim_start();
        if word.is_empty() {
            return Err(ApiError::bad("bad_words must not contain empty words", Some("bad_words")));
        }
        let alone = tok.encode(word, false)?;
        let spaced = tok.encode(&format!(" {word}"), false)?;
        if spaced.len() == alone.len() && spaced.first() != alone.first() {
            params.bad_words_ids.push(spaced);
        }
        params.bad_words_ids.push(alone);
    }
    params.validate().map_err(|e| ApiError::bad(e.to_string(), Some(e.param)))
}

/// SamplingParams from the request's fields, unset ones from `model` (the model's
/// generation config) and then vLLM's defaults; `logprobs` is the per-token top count.
fn sampling(
    f: &SamplingFields,
    model: &SamplingDefaults,
    default_max: Option<usize>,
    logprobs: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let n = check_n(f)?;
    let params = SamplingParams {
        n,
        temperature: f.temperature.or(model.temperature).unwrap_or(d.temperature),
        top_p: f.top_p.or(model.top_p).unwrap_or(d.top_p),
        top_k: f.top_k.or(model.top_k).unwrap_or(d.top_k),
        min_p: f.min_p.or(model.min_p).unwrap_or(d.min_p),
        repetition_penalty: f.repetition_penalty.or(model.repetition_penalty).unwrap_or(d.repetition_penalty),
        presence_penalty: f.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: f.frequency_penalty.unwrap_or(d.frequency_penalty),
        seed: f.seed,
        max_tokens: f.max_completion_tokens.or(f.max_tokens).or(model.max_tokens).or(default_max),
        min_tokens: f.min_tokens.unwrap_or(0),
        stop: match &f.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        },
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        include_stop_str_in_output: f.include_stop_str_in_output.unwrap_or(false),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs,
        prompt_logprobs: None,
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        guide: None,
        logit_bias: logit_bias(f)?,
        allowed_token_ids: f.allowed_token_ids.clone(),
        bad_words_ids: Vec::new(),
        priority: f.priority.unwrap_or(0),
        beam: beam(f, n)?,
    };
    params.validate().map_err(|e| ApiError::bad(e.to_string(), Some(e.param)))?;
    Ok(params)
}

/// The served name asked for (the primary one when absent), or 404 for any other.
pub fn resolve_model(served: &[String], requested: &Option<String>) -> Result<String, ApiError> {
    match requested {
        Some(m) if served.contains(m) => Ok(m.clone()),
        Some(m) => Err(ApiError::ModelNotFound(m.clone())),
        None => Ok(served.first().cloned().unwrap_or_default()),
    }
}

/// (name for responses, adapter) from `model` and `lora_request`. A `model` that is not a
/// served name is taken as an adapter name (vLLM's convention) when LoRA is on; the engine
/// answers 404 for an unknown adapter, never falling back to the base model.
fn resolve_target(
    engine: &Engine,
    served: &[String],
    model: &Option<String>,
    lora: &Option<LoraRequestIn>,
) -> Result<(String, Option<String>), ApiError> {
    let lora_on = engine.lora_manager().is_some();
    if let Some(l) = lora {
        if !lora_on {
            return Err(ApiError::bad(
                "lora_request needs a server started with --enable-lora",
                Some("lora_request"),
            ));
        }
        if let Some(m) = model
            && !served.contains(m)
            && *m != l.lora_name
        {
            return Err(ApiError::ModelNotFound(m.clone()));
        }
        return Ok((l.lora_name.clone(), Some(l.lora_name.clone())));
    }
    match model {
        Some(m) if !served.contains(m) && lora_on => Ok((m.clone(), Some(m.clone()))),
        _ => Ok((resolve_model(served, model)?, None)),
    }
}

/// Rejects a request whose prompt plus completion cannot fit the context.
/// Each prompt fits the context with its max_tokens, and the request's sequences (n per
/// prompt) fit in one batch.
fn check_context(prompts: &[Vec<u32>], params: &SamplingParams, engine: &Engine) -> Result<(), ApiError> {
    let (max_model_len, max_seqs) = (engine.config().max_model_len, engine.config().max_num_seqs);
    if prompts.len() * params.n > max_seqs {
        return Err(ApiError::bad(
            format!(
                "n ({}) times the number of prompts ({}) is {} sequences, over this server's \
                 --max-num-seqs of {max_seqs}: send fewer prompts or choices per request",
                params.n,
                prompts.len(),
                prompts.len() * params.n
            ),
            Some("n"),
        ));
    }
    for p in prompts {
        if p.is_empty() {
            return Err(ApiError::bad("The prompt is empty.", Some("prompt")));
        }
        if p.len() >= max_model_len {
            return Err(ApiError::context_length(p.len(), 0, max_model_len));
        }
        // p.len() < max_model_len here: no overflow whatever max_tokens is.
        if let Some(m) = params.max_tokens
            && m > max_model_len - p.len()
        {
            return Err(ApiError::context_length(p.len(), m, max_model_len));
        }
    }
    Ok(())
}

/// Bounds on a request's size that protect the other users.
pub const MAX_PROMPTS: usize = 64;

pub fn prepare_completion(
    engine: &Engine,
    served: &[String],
    req: CompletionRequest,
) -> Result<Prepared, ApiError> {
    let (model, lora) = resolve_target(engine, served, &req.model, &req.lora_request)?;
    let rules = req.structured.rules(engine, false)?;
    req.unimplemented.check()?;
    if req.suffix.is_some() {
        return Err(ApiError::bad("suffix is not supported", Some("suffix")));
    }
    let logprobs =
        req.logprobs.map(|l| logprob_count(l, "logprobs", engine.config().max_logprobs)).transpose()?;
    let mut params = sampling(&req.sampling, &engine.config().sampling_defaults, Some(16), logprobs)?;
    token_fields(&mut params, &req.sampling, engine)?;
    params.guide = compile(engine, rules.guide)?;
    let tok = engine.tokenizer();
    let (prompts, texts): (Vec<Vec<u32>>, Vec<Option<String>>) = match req.prompt {
        PromptInput::Text(t) => (vec![tok.encode(&t, true)?], vec![Some(t)]),
        PromptInput::Texts(ts) => {
            let ids = ts.iter().map(|t| tok.encode(t, true)).collect::<Result<_, _>>()?;
            (ids, ts.into_iter().map(Some).collect())
        }
        PromptInput::Ids(ids) => (vec![ids], vec![None]),
        PromptInput::IdLists(l) => {
            let n = l.len();
            (l, vec![None; n])
        }
    };
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(ApiError::bad(
            format!("prompt must hold between 1 and {MAX_PROMPTS} prompts"),
            Some("prompt"),
        ));
    }
    let vocab = engine.model_config().vocab_size;
    if let Some(bad) = prompts.iter().flatten().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad(
            format!("token id {bad} is out of vocabulary (size {vocab})"),
            Some("prompt"),
        ));
    }
    check_context(&prompts, &params, engine)?;
    check_beam(&params, req.stream)?;
    let echo = match req.echo {
        true => prompts
            .iter()
            .zip(texts)
            .map(|(ids, t)| {
                Ok(Some(match t {
                    Some(t) => t,
                    None => tok.decode(ids, false)?,
                }))
            })
            .collect::<Result<_, ApiError>>()?,
        false => vec![None; prompts.len()],
    };
    Ok(Prepared {
        endpoint: Endpoint::Completions,
        model,
        lora,
        prompts,
        echo,
        params,
        stream: req.stream,
        stream_options: req.stream_options.unwrap_or_default(),
        tools: None,
        reasoning: None,
    })
}

/// The request's grammar compiled against the model's vocabulary: 400 naming the field
/// and the problem when it does not compile.
fn compile(
    engine: &Engine,
    guide: Option<(GuideSpec, &'static str)>,
) -> Result<Option<crate::structured::Guide>, ApiError> {
    let Some((spec, field)) = guide else { return Ok(None) };
    let kind = spec.kind();
    engine
        .compile_guide(spec)
        .map(Some)
        .map_err(|e| ApiError::bad(format!("{field}: the {kind} cannot be used: {e}"), Some(field)))
}

fn message_text(m: &MessageIn, i: usize) -> Result<String, ApiError> {
    match &m.content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::bad(
                            format!("messages[{i}].content: part type {kind:?} is not supported (text only)"),
                            Some("messages"),
                        ));
                    }
                }
            }
            Ok(out)
        }
    }
}

/// Chat messages with their content flattened to text (text parts only).
pub fn chat_messages(msgs: &[MessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::bad(
                    format!("messages[{i}].role must be one of {}, not {:?}", ROLES.join(", "), m.role),
                    Some("messages"),
                ));
            }
            // Templates read a call's arguments as an object (vLLM parses them likewise).
            let tool_calls = m.tool_calls.clone().map(|calls| {
                calls
                    .into_iter()
                    .map(|mut c| {
                        let parsed = c["function"]["arguments"]
                            .as_str()
                            .and_then(|a| serde_json::from_str::<Value>(a).ok());
                        if let Some(args) = parsed {
                            c["function"]["arguments"] = args;
                        }
                        c
                    })
                    .collect()
            });
            Ok(ChatMessage {
                role: m.role.clone(),
                content: message_text(m, i)?,
                tool_calls,
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
            })
        })
        .collect()
}

pub fn prepare_chat(engine: &Engine, served: &[String], req: ChatRequest) -> Result<Prepared, ApiError> {
    let (model, lora) = resolve_target(engine, served, &req.model, &req.lora_request)?;
    let rules = req.structured.rules(engine, true)?;
    req.unimplemented.check()?;
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty", Some("messages")));
    }
    let messages = chat_messages(&req.messages)?;
    let asked = req
        .top_logprobs
        .map(|t| logprob_count(t, "top_logprobs", engine.config().max_logprobs))
        .transpose()?;
    let top = match (req.logprobs, asked) {
        (false, Some(t)) if t > 0 => {
            return Err(ApiError::bad("top_logprobs requires logprobs to be true", Some("top_logprobs")));
        }
        (true, t) => Some(t.unwrap_or(0)),
        (false, _) => None,
    };
    let mut params = sampling(&req.sampling, &engine.config().sampling_defaults, None, top)?;
    token_fields(&mut params, &req.sampling, engine)?;
    params.guide = compile(engine, rules.guide)?;
    let tok = engine.tokenizer();
    let options = ChatTemplateOptions { tools: rules.template_tools.as_deref(), ..req.template.options() };
    let text = tok.apply_chat_template_with(&messages, &options)?;
    let ids = tok.encode(&text, false)?;
    let prompts = vec![ids];
    check_context(&prompts, &params, engine)?;
    check_beam(&params, req.stream)?;
    let echo = vec![req.echo.then(|| messages.last().map(|m| m.content.clone()).unwrap_or_default())];
    Ok(Prepared {
        endpoint: Endpoint::Chat,
        model,
        lora,
        prompts,
        echo,
        params,
        stream: req.stream,
        stream_options: req.stream_options.unwrap_or_default(),
        tools: rules.tools,
        reasoning: engine.config().reasoning_parser,
    })
}
