//! The parsers on outputs in each model family's format: well formed, with text around the
//! calls, several calls, and malformed text (which comes back as content).

use super::*;

fn calls(v: &[(&str, &str)]) -> Vec<ToolCall> {
    v.iter().map(|(n, a)| ToolCall { name: n.to_string(), arguments: a.to_string() }).collect()
}

const HERMES: ToolMode = ToolMode::Auto(ToolParser::Hermes);
const LLAMA: ToolMode = ToolMode::Auto(ToolParser::Llama3Json);
const MISTRAL: ToolMode = ToolMode::Auto(ToolParser::Mistral);

#[test]
fn hermes_calls_parse_with_text_before_and_several_calls() {
    // Qwen2.5-7B-Instruct's output for a weather question.
    let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";
    assert_eq!(
        HERMES.parse(out),
        (String::new(), calls(&[("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#)]))
    );
    let out = "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}\n</tool_call>";
    let (content, found) = HERMES.parse(out);
    assert_eq!(content, "Let me check both.\n");
    assert_eq!(
        found,
        calls(&[("get_weather", r#"{"city": "Paris"}"#), ("get_time", r#"{"tz": "Europe/Paris"}"#)])
    );
    // Plain text is content.
    assert_eq!(HERMES.parse("The weather is fine."), ("The weather is fine.".into(), vec![]));
}

#[test]
fn malformed_calls_come_back_as_content() {
    for out in [
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
        "<tool_call>\n{\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "<tool_call>not json at all</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": tru}}</tool_call>",
    ] {
        assert_eq!(HERMES.parse(out), (out.to_string(), vec![]), "{out}");
    }
    assert_eq!(
        LLAMA.parse("{\"name\": \"f\", \"parameters\": "),
        ("{\"name\": \"f\", \"parameters\": ".into(), vec![])
    );
    assert_eq!(
        MISTRAL.parse("[TOOL_CALLS][{\"name\": \"f\""),
        ("[TOOL_CALLS][{\"name\": \"f\"".into(), vec![])
    );
}

#[test]
fn llama3_json_calls_parse_with_or_without_the_python_tag() {
    // Llama-3.1-8B-Instruct's output.
    let out = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    assert_eq!(LLAMA.parse(out), (String::new(), calls(&[("get_weather", r#"{"city": "Paris"}"#)])));
    let out = "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": [1, 2]}}";
    assert_eq!(LLAMA.parse(out).1, calls(&[("a", "{}"), ("b", r#"{"x": [1, 2]}"#)]));
    // Text that does not start with a call is content, braces and all.
    let out = "Here is JSON: {\"name\": \"a\", \"parameters\": {}}";
    assert_eq!(LLAMA.parse(out), (out.into(), vec![]));
}

#[test]
fn mistral_calls_parse_in_both_formats() {
    let out = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
    assert_eq!(
        MISTRAL.parse(out),
        (String::new(), calls(&[("get_weather", r#"{"city": "Paris"}"#), ("get_time", "{}")]))
    );
    let out = "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}";
    assert_eq!(
        MISTRAL.parse(out),
        ("Sure.".into(), calls(&[("get_weather", r#"{"city": "Paris"}"#), ("get_time", "{}")]))
    );
}

#[test]
fn required_and_named_outputs_parse_from_their_grammar_shapes() {
    let out = r#"[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "UTC"}}]"#;
    assert_eq!(
        ToolMode::Required.parse(out).1,
        calls(&[("get_weather", r#"{"city": "Paris"}"#), ("get_time", r#"{"tz": "UTC"}"#)])
    );
    let named = ToolMode::Named("get_weather".into());
    assert_eq!(
        named.parse(r#"{"city": "Paris"}"#),
        (String::new(), calls(&[("get_weather", r#"{"city": "Paris"}"#)]))
    );
}

/// Streams `out` in pieces of `step` bytes (at char boundaries); returns the content and
/// each call's (id, name, arguments) as a client would put them together.
fn stream(mode: ToolMode, out: &str, step: usize) -> (String, Vec<(String, String, String)>) {
    let mut s = ToolStream::new(mode, "call-x".into());
    let (mut content, mut calls): (String, Vec<(String, String, String)>) = (String::new(), Vec::new());
    let mut apply = |d: StreamDelta, content: &mut String| {
        content.push_str(&d.content);
        for c in d.calls {
            if let Some((id, name)) = c.header {
                assert_eq!(c.index, calls.len(), "headers come in order");
                calls.push((id, name, String::new()));
            }
            calls[c.index].2.push_str(&c.arguments);
        }
    };
    let mut at = 0;
    while at < out.len() {
        let mut end = (at + step).min(out.len());
        while !out.is_char_boundary(end) {
            end += 1;
        }
        apply(s.push(&out[at..end]), &mut content);
        at = end;
    }
    apply(s.finish(), &mut content);
    (content, calls)
}

#[test]
fn streamed_calls_add_up_to_the_parsed_ones_whatever_the_pieces() {
    let cases: [(ToolMode, &str); 5] = [
        (
            HERMES,
            "Checking é.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
        ),
        (
            LLAMA,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"q\": \"x}\"}}; {\"name\": \"b\", \"parameters\": {}}",
        ),
        (MISTRAL, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"n\": 3}}]"),
        (ToolMode::Required, r#"[{"name": "f", "parameters": {"n": [1, {"k": "]"}]}}]"#),
        (ToolMode::Named("f".into()), r#"{"n": 3, "s": "{"}"#),
    ];
    for (mode, out) in cases {
        let (content, parsed) = mode.parse(out);
        for step in [1, 2, 3, 7, 1000] {
            let (c, streamed) = stream(mode.clone(), out, step);
            assert_eq!(c.trim_end(), content.trim_end(), "{out} in pieces of {step}");
            let got: Vec<ToolCall> = streamed
                .iter()
                .map(|(_, n, a)| ToolCall { name: n.clone(), arguments: a.trim().to_string() })
                .collect();
            assert_eq!(got, parsed, "{out} in pieces of {step}");
            assert!(streamed.iter().enumerate().all(|(i, (id, _, _))| *id == format!("call-x-{i}")));
        }
    }
    // Text that only looked like a call's start is content in the end.
    assert_eq!(stream(HERMES, "a <tool_c", 1).0, "a <tool_c");
    assert_eq!(stream(HERMES, "<tool_call>{\"name\": ", 2), ("<tool_call>{\"name\": ".into(), vec![]));
}
