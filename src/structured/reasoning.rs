//! Reasoning output, as vLLM's `--reasoning-parser` reads it: the model thinks inside
//! `<think> ... </think>` before it answers, and the thinking goes to `reasoning_content`.
//!
//! - `deepseek_r1`: the chat template opens the block in the prompt, so the output starts
//!   inside it (a leading `<think>` is dropped): everything before `</think>` is
//!   reasoning, and an output without `</think>` is all reasoning.
//! - `qwen3`: the output reasons only when it starts with `<think>` (thinking may be off);
//!   otherwise it is all content.

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// vLLM's `--reasoning-parser` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParser {
    #[value(name = "deepseek_r1")]
    DeepseekR1,
    #[value(name = "qwen3")]
    Qwen3,
}

impl ReasoningParser {
    /// (reasoning, content) of a whole output; None reasoning when the output has none.
    pub fn split(self, text: &str) -> (Option<String>, String) {
        let mut s = ReasoningStream::new(self);
        let (mut r, mut c) = s.push(text);
        let (r2, c2) = s.finish();
        r.push_str(&r2);
        c.push_str(&c2);
        (s.reasoned.then_some(r), c)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Not yet known whether the output reasons (qwen3: it may start with `<think>`).
    Opening,
    Thinking,
    Answering,
}

/// One choice's output split into reasoning and content while it streams. Text that may
/// be the start of a marker is held back until the next piece tells.
pub struct ReasoningStream {
    parser: ReasoningParser,
    phase: Phase,
    held: String,
    reasoned: bool,
}

impl ReasoningStream {
    pub fn new(parser: ReasoningParser) -> Self {
        Self { parser, phase: Phase::Opening, held: String::new(), reasoned: false }
    }

    /// Whether the output has reached its answer (the text after the reasoning).
    pub fn answering(&self) -> bool {
        self.phase == Phase::Answering
    }

    /// (reasoning, content) that `piece` makes certain.
    pub fn push(&mut self, piece: &str) -> (String, String) {
        self.held.push_str(piece);
        let (mut reasoning, mut content) = (String::new(), String::new());
        loop {
            match self.phase {
                Phase::Opening => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_START) {
                        self.held = rest.to_string();
                        self.phase = Phase::Thinking;
                        self.reasoned = true;
                    } else if THINK_START.starts_with(t) {
                        // Empty, or the start of `<think>`: the next piece tells.
                        return (reasoning, content);
                    } else {
                        self.phase = match self.parser {
                            ReasoningParser::DeepseekR1 => {
                                self.reasoned = true;
                                Phase::Thinking
                            }
                            ReasoningParser::Qwen3 => Phase::Answering,
                        };
                    }
                }
                Phase::Thinking => {
                    if let Some(at) = self.held.find(THINK_END) {
                        reasoning.push_str(&self.held[..at]);
                        self.held = self.held[at + THINK_END.len()..].to_string();
                        self.phase = Phase::Answering;
                        continue;
                    }
                    let keep = super::marker_prefix_len(&self.held, THINK_END);
                    let cut = self.held.len() - keep;
                    reasoning.push_str(&self.held[..cut]);
                    self.held = self.held[cut..].to_string();
                    return (reasoning, content);
                }
                Phase::Answering => {
                    content.push_str(&self.held);
                    self.held.clear();
                    return (reasoning, content);
                }
            }
        }
    }

    /// The end of the output: whatever was held back.
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Thinking => (held, String::new()),
            Phase::Opening if self.parser == ReasoningParser::DeepseekR1 && !held.trim().is_empty() => {
                self.reasoned = true;
                (held, String::new())
            }
            _ => (String::new(), held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_reasons_only_inside_a_leading_think_block() {
        let p = ReasoningParser::Qwen3;
        assert_eq!(
            p.split("<think>\nThe user greets.\n</think>\n\nHello!"),
            (Some("\nThe user greets.\n".into()), "\n\nHello!".into())
        );
        assert_eq!(p.split("Hello! <think>x</think>"), (None, "Hello! <think>x</think>".into()));
        // Cut off while thinking: all reasoning.
        assert_eq!(p.split("<think>still going"), (Some("still going".into()), String::new()));
    }

    #[test]
    fn deepseek_r1_output_is_reasoning_until_the_end_marker() {
        let p = ReasoningParser::DeepseekR1;
        assert_eq!(
            p.split("Let me add: 4.</think>The answer is 4."),
            (Some("Let me add: 4.".into()), "The answer is 4.".into())
        );
        assert_eq!(p.split("<think>a</think>b"), (Some("a".into()), "b".into()));
        assert_eq!(p.split("no end"), (Some("no end".into()), String::new()));
    }

    #[test]
    fn streamed_pieces_add_up_to_the_split_whatever_their_size() {
        for p in [ReasoningParser::Qwen3, ReasoningParser::DeepseekR1] {
            for out in
                ["<think>\nhm é </thi</think>\n\nAnswer </think>", "  <thi", "plain answer", "<think>x"]
            {
                let want = p.split(out);
                for step in 1..6 {
                    let mut s = ReasoningStream::new(p);
                    let (mut r, mut c) = (String::new(), String::new());
                    let chars: Vec<char> = out.chars().collect();
                    for piece in chars.chunks(step) {
                        let (a, b) = s.push(&piece.iter().collect::<String>());
                        r.push_str(&a);
                        c.push_str(&b);
                    }
                    let (a, b) = s.finish();
                    r.push_str(&a);
                    c.push_str(&b);
                    assert_eq!(
                        (want.0.clone().unwrap_or_default(), want.1.clone()),
                        (r, c),
                        "{p:?} {out:?} by {step}"
                    );
                }
            }
        }
    }
}
