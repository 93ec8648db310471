//! Tokenizer of a model directory: `tokenizer.json` through the `tokenizers` crate, the chat
//! template (tokenizer_config.json's `chat_template` or `chat_template.jinja`) rendered by
//! minijinja with Hugging Face's semantics, the EOS ids of generation_config.json, and an
//! incremental detokenizer for streaming.

use std::path::Path;

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("missing file {0}: a model directory needs tokenizer.json")]
    Missing(String),
    #[error("{path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenize(String),
    #[error(
        "this model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); use the completions endpoint"
    )]
    NoChatTemplate,
    #[error("chat template: {0}")]
    Template(String),
}

/// Chat template steps allowed for a render: this much, and this much again per message.
const TEMPLATE_FUEL_BASE: u64 = 200_000;
const TEMPLATE_FUEL_PER_MESSAGE: u64 = 20_000;

/// Runs a tokenizers call, turning a panic inside it into an error.
fn guard<T>(f: impl FnOnce() -> T) -> Result<T, TokenizerError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let why = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        TokenizerError::Tokenize(format!("the tokenizer failed: {why}"))
    })
}

/// One chat turn as OpenAI clients send it (content already flattened to text), with the
/// tool fields chat templates read: an assistant turn's `tool_calls` (each function's
/// `arguments` as an object, as HF templates expect) and a tool turn's `tool_call_id`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: String,
    eos_token: String,
    /// Ids that end generation: generation_config.json's, else the config's, else eos_token's.
    pub eos_ids: Vec<u32>,
    /// Each id's raw bytes when the decoder is byte-level (GPT-2 style: Llama 3, Qwen,
    /// SmolLM2), where decoding is joining bytes; None for other decoders.
    bytes: Option<TokenBytes>,
}

/// The bytes a byte-level decoder gives each token id, and which ids are special.
struct TokenBytes {
    data: Vec<u8>,
    /// Id i's bytes are `data[ends[i - 1]..ends[i]]` (from 0 for id 0).
    ends: Vec<u32>,
    special: Vec<bool>,
}

impl TokenBytes {
    /// The table of a byte-level tokenizer, or None for any other decoder. A token whose
    /// characters all come from the byte alphabet stands for those bytes; any other
    /// (an added token such as "<|im_start|>" written outside the alphabet) for its UTF-8,
    /// as the `tokenizers` decoder has it.
    fn of(inner: &tokenizers::Tokenizer) -> Option<Self> {
        if !matches!(inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let alphabet = byte_alphabet();
        let added = inner.get_added_tokens_decoder();
        let n = inner.get_vocab_size(true);
        let (mut data, mut ends, mut special) = (Vec::new(), Vec::with_capacity(n), Vec::with_capacity(n));
        for id in 0..n as u32 {
            // An id without a token (a gap in the vocabulary) decodes to nothing.
            let token = inner.id_to_token(id).unwrap_or_default();
            let mapped: Option<Vec<u8>> = token.chars().map(|c| alphabet.get(&c).copied()).collect();
            data.extend(mapped.unwrap_or_else(|| token.as_bytes().to_vec()));
            ends.push(data.len() as u32);
            special.push(added.get(&id).is_some_and(|t| t.special));
        }
        Some(Self { data, ends, special })
    }

    /// The id's bytes; nothing for an id past the vocabulary or (when skipping) a special one.
    fn get(&self, id: u32, skip_special_tokens: bool) -> &[u8] {
        let i = id as usize;
        if i >= self.ends.len() || (skip_special_tokens && self.special[i]) {
            return &[];
        }
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.data[start..self.ends[i] as usize]
    }
}

/// GPT-2's byte alphabet: the printable bytes stand for themselves, the other 68 for the
/// characters from U+0100 on, in byte order.
fn byte_alphabet() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(next - 1).expect("below U+0200")
            };
            (c, b)
        })
        .collect()
}

/// `"<s>"` or `{"content": "<s>", ...}` in tokenizer_config.json.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// A JSON file of the tokenizer's, by name: None when absent.
fn parse_json(name: &str, bytes: Option<&[u8]>) -> Result<Value, TokenizerError> {
    let Some(bytes) = bytes else { return Ok(Value::Null) };
    let err = |message: String| TokenizerError::Load { path: name.to_string(), message };
    serde_json::from_slice(bytes).map_err(|e| err(e.to_string()))
}

/// The files of a model directory a [`Tokenizer`] is made from, as bytes (None: absent).
#[derive(Default, Clone, Copy)]
pub struct TokenizerFiles<'a> {
    pub tokenizer_json: &'a [u8],
    pub tokenizer_config: Option<&'a [u8]>,
    pub chat_template_jinja: Option<&'a [u8]>,
    pub generation_config: Option<&'a [u8]>,
}

fn ids_of(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n.as_u64().map(|i| vec![i as u32]).unwrap_or_default(),
        Value::Array(a) => a.iter().filter_map(|x| x.as_u64().map(|i| i as u32)).collect(),
        _ => Vec::new(),
    }
}

impl Tokenizer {
    /// Loads the tokenizer files of `dir`; `config_eos` is config.json's `eos_token_id`.
    pub fn load(dir: &Path, config_eos: &[u32]) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(TokenizerError::Missing(path.display().to_string()));
        }
        let read = |name: &str| -> Result<Option<Vec<u8>>, TokenizerError> {
            let p = dir.join(name);
            if !p.exists() {
                return Ok(None);
            }
            let err = |e: std::io::Error| TokenizerError::Load {
                path: p.display().to_string(),
                message: e.to_string(),
            };
            std::fs::read(&p).map(Some).map_err(err)
        };
        let json = read("tokenizer.json")?.unwrap_or_default();
        let (config, jinja) = (read("tokenizer_config.json")?, read("chat_template.jinja")?);
        let generation = read("generation_config.json")?;
        let files = TokenizerFiles {
            tokenizer_json: &json,
            tokenizer_config: config.as_deref(),
            chat_template_jinja: jinja.as_deref(),
            generation_config: generation.as_deref(),
        };
        Self::from_files(files, config_eos).map_err(|e| match e {
            TokenizerError::Load { path, message } => {
                TokenizerError::Load { path: dir.join(path).display().to_string(), message }
            }
            other => other,
        })
    }

    /// A tokenizer from its files' bytes; errors name the file (without a directory).
    pub fn from_files(files: TokenizerFiles<'_>, config_eos: &[u32]) -> Result<Self, TokenizerError> {
        let load_err = |name: &str, message: String| TokenizerError::Load { path: name.to_string(), message };
        // tokenizers panics on some malformed parts (a decoder with a bad field) instead of
        // returning an error.
        let inner = guard(|| tokenizers::Tokenizer::from_bytes(files.tokenizer_json))
            .map_err(|e| load_err("tokenizer.json", e.to_string()))?
            .map_err(|e| load_err("tokenizer.json", e.to_string()))?;
        let cfg = parse_json("tokenizer_config.json", files.tokenizer_config)?;
        let mut chat_template = match &cfg["chat_template"] {
            Value::String(s) => Some(s.clone()),
            // A list of named templates: take "default".
            Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str().map(str::to_string)),
            _ => None,
        };
        if chat_template.is_none()
            && let Some(jinja) = files.chat_template_jinja
        {
            let text =
                std::str::from_utf8(jinja).map_err(|e| load_err("chat_template.jinja", e.to_string()))?;
            chat_template = Some(text.to_string());
        }
        let bos_token = token_text(&cfg["bos_token"]).unwrap_or_default();
        let eos_token = token_text(&cfg["eos_token"]).unwrap_or_default();
        let generation = parse_json("generation_config.json", files.generation_config)?;
        let mut eos_ids = ids_of(&generation["eos_token_id"]);
        if eos_ids.is_empty() {
            eos_ids = config_eos.to_vec();
        }
        if eos_ids.is_empty()
            && let Some(id) = inner.token_to_id(&eos_token)
        {
            eos_ids.push(id);
        }
        let bytes = TokenBytes::of(&inner);
        let tok = Self { inner, chat_template, bos_token, eos_token, eos_ids, bytes };
        // A tokenizer.json whose post-processor or normalizer refers to what it lacks
        // panics inside tokenizers on the first encode: refuse it here, by name.
        tok.encode("Hello, world!", true).map_err(|e| {
            load_err("tokenizer.json", format!("the tokenizer cannot encode a plain sentence ({e})"))
        })?;
        Ok(tok)
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = guard(|| self.inner.encode(text, add_special_tokens))?
            .map_err(|e| TokenizerError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        guard(|| self.inner.decode(ids, skip_special_tokens))?
            .map_err(|e| TokenizerError::Tokenize(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The token's text (for logprobs), or "" for an unknown id.
    pub fn id_to_token(&self, id: u32) -> String {
        self.decode(&[id], false).unwrap_or_default()
    }

    /// Replaces the model's chat template (`--chat-template`).
    pub fn set_chat_template(&mut self, template: String) {
        self.chat_template = Some(template);
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template as HF's `apply_chat_template(tokenize=False)` does.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let opts = ChatTemplateOptions { add_generation_prompt, ..Default::default() };
        self.apply_chat_template_with(messages, &opts)
    }

    /// As [`Self::apply_chat_template`], with HF's other options: another template, extra
    /// template variables, and `continue_final_message` (the text ends inside the last
    /// message, as HF cuts it, so that generation continues it).
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        opts: &ChatTemplateOptions<'_>,
    ) -> Result<String, TokenizerError> {
        if opts.add_generation_prompt && opts.continue_final_message {
            return Err(TokenizerError::Template(
                "continue_final_message and add_generation_prompt cannot both be true".into(),
            ));
        }
        let template =
            opts.template.or(self.chat_template.as_deref()).ok_or(TokenizerError::NoChatTemplate)?;
        let mut env = Environment::new();
        // HF renders with trim_blocks and lstrip_blocks, and exposes raise_exception.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // A template that loops without end fails instead of holding its thread: real
        // templates spend tens of steps a message, far below this.
        env.set_fuel(Some(TEMPLATE_FUEL_BASE + TEMPLATE_FUEL_PER_MESSAGE * messages.len() as u64));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", hf_tojson);
        env.add_template("chat", template).map_err(|e| TokenizerError::Template(e.to_string()))?;
        let tmpl = env.get_template("chat").map_err(|e| TokenizerError::Template(e.to_string()))?;
        let empty = serde_json::Map::new();
        let kwargs = minijinja::Value::from_serialize(opts.kwargs.unwrap_or(&empty));
        let rendered = tmpl
            .render(context! {
                messages => messages,
                tools => opts.tools,
                add_generation_prompt => opts.add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                ..kwargs
            })
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        match (opts.continue_final_message, messages.last()) {
            (true, Some(last)) => cut_after_final_message(rendered, &last.content),
            _ => Ok(rendered),
        }
    }

    /// Every id's bytes as generated text holds them, for a grammar engine: special tokens
    /// marked (`None`), ids without a token empty. Byte-level tokenizers map their
    /// alphabet back to bytes; SentencePiece-style ones turn `▁` into a space and
    /// `<0xNN>` into its byte.
    pub fn all_token_bytes(&self) -> Vec<Option<Vec<u8>>> {
        let added = self.inner.get_added_tokens_decoder();
        let n = self.vocab_size() as u32;
        (0..n)
            .map(|id| {
                if added.get(&id).is_some_and(|t| t.special) {
                    return None;
                }
                if let Some(table) = &self.bytes {
                    return Some(table.get(id, false).to_vec());
                }
                let token = self.inner.id_to_token(id).unwrap_or_default();
                let hex = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'));
                if let Some(b) = hex.filter(|h| h.len() == 2).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    return Some(vec![b]);
                }
                if added.contains_key(&id) {
                    return Some(token.into_bytes());
                }
                Some(token.replace('\u{2581}', " ").into_bytes())
            })
            .collect()
    }

    /// The text of a special token (`<|im_end|>`), for a grammar engine's table.
    pub fn special_text(&self, id: u32) -> String {
        self.inner.id_to_token(id).unwrap_or_default()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }
}

/// HF's `tojson` filter: Python's `json.dumps` with `ensure_ascii=False`, its `", "` and
/// `": "` separators (`","` at line ends with `indent`), keys in their given order.
fn hf_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    py_json(&json, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn py_json(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("a string serializes"));
                out.push_str(": ");
                py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).expect("JSON serializes")),
    }
}

/// Options of [`Tokenizer::apply_chat_template_with`] (HF's `apply_chat_template` keywords).
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatTemplateOptions<'a> {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// A template to render instead of the tokenizer's.
    pub template: Option<&'a str>,
    /// Extra variables for the template (`enable_thinking`, ...); they never replace
    /// `messages`, `add_generation_prompt` or the special tokens.
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
    /// The request's tools (`[{"type": "function", "function": {...}}]`), as `tools`.
    pub tools: Option<&'a [serde_json::Value]>,
}

/// HF's cut for `continue_final_message`: the rendered chat up to the end of the last
/// message's text (keeping its trailing spaces where the template kept them).
fn cut_after_final_message(rendered: String, last: &str) -> Result<String, TokenizerError> {
    let at = rendered.rfind(last.trim()).ok_or_else(|| {
        TokenizerError::Template(
            "continue_final_message is set but the final message does not appear in the chat after applying \
             the chat template"
                .into(),
        )
    })?;
    // HF keeps the message's trailing spaces when the template kept the message whole.
    let whole = last.trim_start().len() == last.len() && rendered[at..].starts_with(last);
    let end = at + if whole { last.len() } else { last.trim().len() };
    Ok(rendered[..end].to_string())
}

/// Streams text from a growing token list without ever emitting a broken UTF-8 sequence:
/// text is released only once the tokens decoded so far end on a whole character. The
/// concatenation of everything released equals a full decode of the generated tokens.
///
/// A byte-level tokenizer's tokens are joined as bytes (no decode call per token); other
/// tokenizers decode a window of the last few tokens twice per step, as vLLM does.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
    /// Byte-level path: the bytes of a character whose last bytes have not come yet.
    pending: Vec<u8>,
}

impl IncrementalDetokenizer {
    /// `prompt_len` tokens precede the generated ones; a few of them are kept as left
    /// context so that tokenizers that strip a leading space decode correctly.
    pub fn new(prompt_len: usize, skip_special_tokens: bool) -> Self {
        Self {
            prefix_offset: prompt_len.saturating_sub(5),
            read_offset: prompt_len,
            skip_special_tokens,
            pending: Vec::new(),
        }
    }

    /// Text made stable by the last token of `tokens` (prompt + generated so far).
    pub fn step(&mut self, tok: &Tokenizer, tokens: &[u32]) -> Result<String, TokenizerError> {
        match (&tok.bytes, tokens.last()) {
            (Some(table), Some(&last)) => Ok(self.step_bytes(table, last)),
            (Some(_), None) => Ok(String::new()),
            (None, _) => self.step_window(tok, tokens),
        }
    }

    /// Appends the token's bytes and releases every whole character; a sequence that can
    /// no longer become a character becomes U+FFFD, as a lossy decode of all of them would.
    fn step_bytes(&mut self, table: &TokenBytes, token: u32) -> String {
        self.pending.extend_from_slice(table.get(token, self.skip_special_tokens));
        let mut text = String::new();
        let mut rest = self.pending.as_slice();
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    text.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, bad) = rest.split_at(e.valid_up_to());
                    text.push_str(std::str::from_utf8(valid).expect("checked up to here"));
                    match e.error_len() {
                        Some(n) => {
                            text.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        // A character cut short by the end: wait for its other bytes.
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        let held = rest.len();
        self.pending.drain(..self.pending.len() - held);
        text
    }

    fn step_window(&mut self, tok: &Tokenizer, tokens: &[u32]) -> Result<String, TokenizerError> {
        let skip = self.skip_special_tokens;
        let prefix = tok.decode(&tokens[self.prefix_offset..self.read_offset], skip)?;
        let full = tok.decode(&tokens[self.prefix_offset..], skip)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let delta = match full.get(prefix.len()..) {
                Some(d) if full.starts_with(&prefix) => d.to_string(),
                // The left context decoded differently once joined: emit what differs.
                _ => {
                    let common =
                        prefix.char_indices().zip(full.chars()).take_while(|((_, a), b)| a == b).count();
                    full.chars().skip(common).collect()
                }
            };
            self.prefix_offset = self.read_offset;
            self.read_offset = tokens.len();
            return Ok(delta);
        }
        Ok(String::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece-style tokenizer (Metaspace decoder: "▁" is a space, and the first
    /// token's leading space is dropped), which streams through decoded windows.
    fn metaspace_tokenizer() -> Tokenizer {
        let dir = crate::scratch::ScratchDir::new("metaspace").unwrap();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "post_processor": null,
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "model": {"type": "WordLevel", "unk_token": "<unk>",
                      "vocab": {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}}
        });
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        Tokenizer::load(dir.path(), &[]).unwrap()
    }

    #[test]
    fn a_non_byte_level_tokenizer_streams_its_continuation_with_the_leading_space() {
        let tok = metaspace_tokenizer();
        assert!(tok.bytes.is_none(), "Metaspace decodes through windows");
        let mut all = vec![1u32];
        let mut detok = IncrementalDetokenizer::new(all.len(), true);
        let pieces: Vec<String> = [2u32, 3, 4, 0, 3]
            .iter()
            .map(|&t| {
                all.push(t);
                detok.step(&tok, &all).unwrap()
            })
            .collect();
        assert_eq!(pieces, [" world", "!", " again", "", "!"]);
        // The continuation is what the whole decodes to past the prompt.
        let whole = tok.decode(&all, true).unwrap();
        assert_eq!(pieces.concat(), whole["Hello".len()..]);
    }

    #[test]
    fn the_byte_alphabet_covers_every_byte_once() {
        let alphabet = byte_alphabet();
        assert_eq!(alphabet.len(), 256);
        let mut bytes: Vec<u8> = alphabet.values().copied().collect();
        bytes.sort_unstable();
        assert_eq!(bytes, (0..=255).collect::<Vec<u8>>());
        // Space, newline and 0xAD are not printable: they are U+0120, U+010A and U+0143.
        assert_eq!((alphabet[&'Ġ'], alphabet[&'Ċ'], alphabet[&'Ń']), (b' ', b'\n', 0xAD));
        assert_eq!(alphabet[&'A'], b'A');
    }

    /// A decoder with a malformed field makes `tokenizers` panic while parsing (found by
    /// the tokenizer fuzz target): the load fails with an error naming the file.
    #[test]
    fn a_malformed_decoder_is_an_error_not_a_panic() {
        let json = br#"{"model":{"type":"WordLevel","vocab":{"Hello":0,"[UNK]":1},"unk_token":"[UNK]"},
            "decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":qrue,"use_regex":true}}"#;
        let files = TokenizerFiles { tokenizer_json: json, ..TokenizerFiles::default() };
        let err = Tokenizer::from_files(files, &[]).err().expect("refused");
        assert!(err.to_string().starts_with("tokenizer.json: "), "{err}");
    }
}
