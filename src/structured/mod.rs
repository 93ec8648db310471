//! Structured output: the grammars a request's output must follow (a JSON schema, a regex,
//! a list of choices, a Lark or GBNF grammar), compiled by llguidance against the model's
//! vocabulary, and each sequence's matcher, which gives the tokens allowed next as a
//! bitmask (bit `t` of word `t / 32` set: token `t` may come next).
//!
//! llguidance was chosen over outlines-core: it computes each mask lazily from the
//! tokenizer's trie (tens of microseconds a token on a 50k vocabulary) where outlines-core
//! builds a whole index per schema up front (seconds for a large one), and it compiles Lark
//! grammars and the JSON Schema features clients send (`$ref`, `anyOf`, string formats and
//! patterns, bounds on arrays), which outlines-core's regex route lacks.
//!
//! A request's grammar is compiled once at the edge (a grammar that does not compile is a
//! 400 before any token is generated); each of its sequences runs a clone of the compiled
//! parser in a [`GuideState`] held by the ModelRunner that samples it.

mod ebnf;
pub mod reasoning;
pub mod tools;

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{Value, json};

use crate::tokenizer::Tokenizer;

pub use ebnf::gbnf_to_lark;

/// What a request's output must match, as the client gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum GuideSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`json_schema`, `guided_json`, a named tool's parameters).
    JsonSchema(Value),
    /// A regular expression the whole output matches (`guided_regex`).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax or in GBNF (`root ::= ...`): `guided_grammar`.
    Grammar(String),
}

impl GuideSpec {
    /// The JSON options this server compiles schemas with unless the schema sets its own
    /// (`x-guidance`): Python's `json.dumps` separators and no free whitespace between
    /// tokens, which small models otherwise fill without end; `oneOf` taken as `anyOf`.
    fn json_options() -> Value {
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": true})
    }

    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            GuideSpec::JsonObject => TopLevelGrammar::from_json_schema(
                json!({"type": "object", "x-guidance": Self::json_options()}),
            ),
            GuideSpec::JsonSchema(schema) => {
                let mut schema = match schema {
                    Value::Bool(true) => json!({}),
                    Value::Object(_) => schema.clone(),
                    other => return Err(format!("a JSON schema must be an object, got {other}")),
                };
                if schema.get("x-guidance").is_none() {
                    schema["x-guidance"] = Self::json_options();
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GuideSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GuideSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err("guided_choice must hold at least one choice".into());
                }
                let alts: Vec<String> =
                    choices.iter().map(|c| serde_json::to_string(c).expect("a string serializes")).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            GuideSpec::Grammar(text) => {
                if text.trim().is_empty() {
                    return Err("the grammar is empty".into());
                }
                let lark = if text.contains("::=") { gbnf_to_lark(text)? } else { text.clone() };
                TopLevelGrammar::from_lark(lark)
            }
        })
    }

    /// What the request asked for, in a few words (for logs and errors).
    pub fn kind(&self) -> &'static str {
        match self {
            GuideSpec::JsonObject => "json_object",
            GuideSpec::JsonSchema(_) => "json_schema",
            GuideSpec::Regex(_) => "regex",
            GuideSpec::Choice(_) => "choice",
            GuideSpec::Grammar(_) => "grammar",
        }
    }
}

/// A compiled grammar, ready to start a matcher for each sequence of its request.
#[derive(Clone)]
pub struct Guide {
    spec: Arc<GuideSpec>,
    parser: Arc<TokenParser>,
    after: Option<u32>,
}

impl Guide {
    pub fn spec(&self) -> &GuideSpec {
        &self.spec
    }

    /// Holds the grammar back until the output holds `token` (the end of a reasoning
    /// block, `</think>`): what comes before it is free text.
    pub fn held_until(mut self, token: Option<u32>) -> Self {
        self.after = token;
        self
    }

    pub fn after(&self) -> Option<u32> {
        self.after
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Guide").field(&self.spec).finish()
    }
}

impl PartialEq for Guide {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

/// The model's vocabulary as llguidance reads it: each id's bytes in a trie.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.tokenizer.encode(s, false).unwrap_or_default())
    }
}

/// Compiles grammars against one model's vocabulary. Built on first use: an engine that
/// never sees a constrained request never pays for the trie.
pub struct Grammars {
    factory: ParserFactory,
    words: usize,
}

impl Grammars {
    /// `vocab` is the model's (the logits' width), at least the tokenizer's.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize) -> Result<Self, String> {
        let mut words: Vec<Vec<u8>> = tokenizer
            .all_token_bytes()
            .into_iter()
            .enumerate()
            .map(|(id, bytes)| {
                bytes.unwrap_or_else(|| {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tokenizer.special_text(id as u32).into_bytes());
                    w
                })
            })
            .collect();
        // Rows of the logits past the tokenizer's ids: never text.
        while words.len() < vocab {
            let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            w.extend(format!("<[{}]>", words.len()).into_bytes());
            words.push(w);
        }
        words.truncate(vocab.max(1));
        let eos: Vec<u32> =
            tokenizer.eos_ids.iter().copied().filter(|&t| (t as usize) < words.len()).collect();
        let info = TokRxInfo::new(words.len() as u32, eos.first().copied().unwrap_or(0));
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self { factory, words: vocab.div_ceil(32) })
    }

    /// Compiles `spec`; the error names what is wrong with it.
    pub fn compile(&self, spec: GuideSpec) -> Result<Guide, String> {
        let grammar = spec.grammar()?;
        let parser = self.factory.create_parser(grammar).map_err(|e| first_line(&e.to_string()))?;
        Ok(Guide { spec: Arc::new(spec), parser: Arc::new(parser), after: None })
    }

    /// Words of a mask over the vocabulary.
    pub fn mask_words(&self) -> usize {
        self.words
    }
}

/// Bytes at the end of `text` that begin `marker` (held back while streaming: the next
/// piece tells whether the marker comes).
pub(crate) fn marker_prefix_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.is_char_boundary(text.len() - k) && marker.starts_with(&text[text.len() - k..]))
        .unwrap_or(0)
}

/// An error's first line (llguidance appends the grammar and parser state after it).
fn first_line(e: &str) -> String {
    e.lines().next().unwrap_or(e).trim().to_string()
}

/// The grammar compiler of an engine, built once on first use.
#[derive(Default)]
pub struct LazyGrammars(OnceLock<Result<Grammars, String>>);

impl LazyGrammars {
    pub fn get(&self, tokenizer: &Arc<Tokenizer>, vocab: usize) -> Result<&Grammars, String> {
        self.0.get_or_init(|| Grammars::new(tokenizer.clone(), vocab)).as_ref().map_err(Clone::clone)
    }
}

/// One sequence's place in its grammar: the generated tokens it has taken, and the mask
/// of the tokens allowed next.
pub struct GuideState {
    matcher: Matcher,
    /// Generated tokens fed to the matcher so far.
    taken: usize,
    /// The end-of-thinking token when the model reasons first: the grammar applies only
    /// after the output holds it.
    after: Option<u32>,
    started: bool,
    eos: u32,
}

impl GuideState {
    /// A matcher for one sequence; `after` holds the grammar back until that token (the
    /// end of a reasoning block) is generated.
    pub fn new(guide: &Guide, after: Option<u32>, eos: u32) -> Self {
        let matcher = Matcher::new(Ok((*guide.parser).clone()));
        Self { matcher, taken: 0, after, started: after.is_none(), eos }
    }

    /// Feeds the generated tokens not yet taken (`generated` is the whole output so far).
    pub fn advance(&mut self, generated: &[u32]) {
        while self.taken < generated.len() {
            let t = generated[self.taken];
            self.taken += 1;
            if !self.started {
                self.started = Some(t) == self.after;
                continue;
            }
            // Past the grammar's end only end tokens come (kept going by ignore_eos).
            if self.matcher.is_stopped() {
                continue;
            }
            if self.matcher.consume_token(t).is_err() {
                // Only a token the mask forbade gets here; the matcher stays in its error
                // state, and the mask allows only the end of the sequence.
                tracing::warn!(token = t, "a token outside the grammar reached its matcher");
            }
        }
    }

    /// Whether the sequence is constrained at this step (false while it still reasons).
    pub fn active(&self) -> bool {
        self.started
    }

    /// Writes the mask of the tokens allowed next into `out` (one bit per token).
    pub fn fill_mask(&mut self, out: &mut [u32]) {
        match self.matcher.compute_mask_or_eos() {
            Ok(vob) => {
                let words = vob.as_slice();
                let n = words.len().min(out.len());
                out[..n].copy_from_slice(&words[..n]);
                out[n..].fill(0);
            }
            Err(_) => {
                out.fill(0);
                if let Some(w) = out.get_mut(self.eos as usize / 32) {
                    *w |= 1 << (self.eos % 32);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
