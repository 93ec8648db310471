//! Structured output and tool calls on the default model through a real server: every
//! output follows its JSON schema, regex or choices, greedy and sampled, in one batch
//! with unconstrained requests; grammars that do not compile are 400s; tool choices that
//! force a call always make one whose arguments follow the function's parameters,
//! streamed or not; the chat template gets the tools and the calls as transformers
//! renders them.

mod common;

use common::structured::{schemas, validator};

use futures::future::join_all;
use serde_json::{Value, json};

async fn chat(s: &common::server::TestServer, body: Value) -> Value {
    let (status, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    v
}

#[actix_rt::test]
async fn every_output_follows_its_schema_greedy_and_sampled_beside_free_requests() {
    let s = common::server::start(&common::default_model(), |_| {}).await;
    let question =
        |i: usize| json!([{"role": "user", "content": format!("Reply in JSON. Example number {i}.")}]);
    let free = json!({"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0});
    let (_, alone) = s.post("/v1/completions", &free).await;
    let schemas = schemas();
    assert!(schemas.len() >= 20);
    // Each schema twice (greedy, then sampled with n = 2) through each way of asking for
    // it, all at once with unconstrained requests in the same batches.
    let mut bodies = Vec::new();
    for (i, schema) in schemas.iter().enumerate() {
        let how = match i % 3 {
            0 => {
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": true}}})
            }
            1 => json!({"guided_json": schema}),
            _ => json!({"structured_outputs": {"json": schema}}),
        };
        for sampling in [json!({"temperature": 0}), json!({"temperature": 1.0, "seed": i, "n": 2})] {
            let mut body = json!({"messages": question(i), "max_tokens": 200});
            for (k, v) in how.as_object().unwrap().iter().chain(sampling.as_object().unwrap()) {
                body[k] = v.clone();
            }
            bodies.push((i, body));
        }
    }
    let frees = join_all((0..4).map(|_| s.post("/v1/completions", &free)));
    let guided = join_all(bodies.iter().map(|(_, b)| chat(&s, b.clone())));
    let (frees, outs) = futures::join!(frees, guided);
    for (status, v) in frees {
        assert_eq!(status, 200);
        assert_eq!(v["choices"][0]["text"], alone["choices"][0]["text"], "a free request beside guided ones");
    }
    for ((i, body), out) in bodies.iter().zip(outs) {
        let check = validator(&schemas[*i]);
        for choice in out["choices"].as_array().unwrap() {
            let text = choice["message"]["content"].as_str().unwrap();
            assert_eq!(choice["finish_reason"], "stop", "schema {i} ({body}) did not finish: {text:?}");
            let value: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("schema {i}: not JSON ({e}): {text:?}"));
            let errors: Vec<String> = check.iter_errors(&value).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "schema {i}: {text} breaks it: {errors:?}");
        }
    }
    // A number's digits have no bound: greedy ends it.
    let number = json!({"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"], "additionalProperties": false});
    let out =
        chat(&s, json!({"messages": question(3), "max_tokens": 60, "temperature": 0, "guided_json": number}))
            .await;
    let value: Value =
        serde_json::from_str(out["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert!(validator(&number).is_valid(&value), "{value}");
    // json_object gives an object.
    let out = chat(
        &s,
        json!({"messages": question(0), "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_object"}}),
    )
    .await;
    let text = out["choices"][0]["message"]["content"].as_str().unwrap();
    if out["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text}");
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
}

#[actix_rt::test]
async fn outputs_match_their_regex_or_choices() {
    let s = common::server::start(&common::default_model(), |_| {}).await;
    let regexes = [
        r"\d{3}-\d{4}",
        r"[A-Z][a-z]{2,8}",
        r"(yes|no)",
        r"[0-9]+\.[0-9]{2}",
        r"#[0-9a-f]{6}",
        r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
        r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)",
        r"(\+|-)?[1-9]\d{0,3}",
        r"[A-Z]{2}\d{2} [A-Z]{3}",
        r"(true|false), (true|false)",
        r"\((1|2|3), (1|2|3)\)",
    ];
    let choices = [
        vec!["Paris", "London", "Berlin"],
        vec!["positive", "negative", "neutral"],
        vec!["A", "B", "C", "D"],
    ];
    let mut bodies = Vec::new();
    for (i, rx) in regexes.iter().enumerate() {
        for t in [0.0, 1.0] {
            let field = if i % 2 == 0 {
                json!({"guided_regex": rx})
            } else {
                json!({"structured_outputs": {"regex": rx}})
            };
            let mut b = json!({"prompt": "Answer: ", "max_tokens": 40, "temperature": t, "seed": i});
            b.as_object_mut().unwrap().extend(field.as_object().unwrap().clone());
            bodies.push((format!("^(?:{rx})$"), b));
        }
    }
    for (i, c) in choices.iter().enumerate() {
        for t in [0.0, 1.0] {
            let rx = format!("^(?:{})$", c.join("|"));
            bodies.push((rx, json!({"prompt": "The answer is", "max_tokens": 10, "temperature": t, "seed": i, "n": 2, "guided_choice": c})));
        }
    }
    // A GBNF grammar and the same language in Lark.
    for g in [
        r#"root ::= "(" num ("," num){0,2} ")"
num ::= [1-9] [0-9]?"#,
        r#"start: "(" num ("," num){0,2} ")"
num: /[1-9][0-9]?/"#,
    ] {
        bodies.push((r"^\([1-9][0-9]?(,[1-9][0-9]?){0,2}\)$".into(), json!({"prompt": "A tuple:", "max_tokens": 20, "temperature": 1.0, "seed": 3, "n": 3, "guided_grammar": g})));
    }
    let outs = join_all(bodies.iter().map(|(_, b)| s.post("/v1/completions", b))).await;
    for ((rx, body), (status, out)) in bodies.iter().zip(outs) {
        assert_eq!(status, 200, "{body}: {out}");
        let re = regex::Regex::new(rx).unwrap();
        for c in out["choices"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            assert!(re.is_match(text), "{text:?} does not match {rx} ({body})");
            assert_eq!(c["finish_reason"], "stop", "{text:?} for {body}");
        }
    }
}

#[actix_rt::test]
async fn grammars_that_cannot_compile_are_400s_naming_the_problem() {
    let s = common::server::start(&common::default_model(), |_| {}).await;
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let cases = [
        (json!({"prompt": "x", "guided_regex": "a(b"}), "guided_regex", "regex"),
        (
            json!({"prompt": "x", "guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}),
            "guided_json",
            "missing",
        ),
        (json!({"prompt": "x", "guided_json": "{not json"}), "guided_json", "not valid JSON"),
        (json!({"prompt": "x", "guided_grammar": "root ::= (\"a\""}), "guided_grammar", "line 1"),
        (
            json!({"prompt": "x", "guided_grammar": "start: undefined_rule"}),
            "guided_grammar",
            "undefined_rule",
        ),
        (json!({"prompt": "x", "guided_choice": []}), "guided_choice", "at least one"),
        (
            json!({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
            "only one kind",
        ),
        (json!({"prompt": "x", "response_format": {"type": "xml"}}), "response_format", "json_schema"),
        (
            json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}),
            "response_format",
            "schema is missing",
        ),
        (json!({"prompt": "x", "structured_outputs": {"nothing": 1}}), "structured_outputs", "one of json"),
        (json!({"prompt": "x", "tools": tool}), "tools", "chat"),
    ];
    for (body, param, words) in cases {
        let (status, v) = s.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(words), "{body}: {msg}");
    }
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for (extra, words) in [
        (json!({"tools": tool}), "--enable-auto-tool-choice"),
        (
            json!({"tools": tool, "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "not among the tools",
        ),
        (json!({"tool_choice": "required"}), "gives no tools"),
        (
            json!({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}),
            "name is missing",
        ),
        (json!({"tools": tool, "tool_choice": "required", "guided_regex": "a"}), "cannot be combined"),
    ] {
        let mut body = json!({"messages": msgs, "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(words), "{body}: {v}");
    }
    // Nothing broke for anyone else.
    let (status, v) = s
        .post("/v1/completions", &json!({"prompt": "Hello", "max_tokens": 3, "guided_choice": ["a b"]}))
        .await;
    assert_eq!((status, v["choices"][0]["text"].as_str()), (200, Some("a b")));
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}}, "required": ["tz"],
                "additionalProperties": false}}},
    ])
}

/// A streamed chat's tool calls put together as a client does: (id, name, arguments).
fn streamed_calls(events: &[String]) -> (Vec<(String, String, String)>, Option<String>) {
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = None;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let Some(choice) = v["choices"].get(0) else { continue };
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        for c in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap() as usize;
            if let Some(id) = c["id"].as_str() {
                assert_eq!(i, calls.len(), "a new call's index follows the last");
                calls.push((id.into(), c["function"]["name"].as_str().unwrap().into(), String::new()));
            }
            calls[i].2.push_str(c["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    (calls, finish)
}

#[actix_rt::test]
async fn required_and_named_tool_choices_always_call_with_valid_arguments() {
    let s = common::server::start(&common::default_model(), |_| {}).await;
    let tools = weather_tools();
    let params: Vec<(String, jsonschema::Validator)> = tools
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (t["function"]["name"].as_str().unwrap().to_string(), validator(&t["function"]["parameters"]))
        })
        .collect();
    let check = |name: &str, args: &str| {
        let v: Value =
            serde_json::from_str(args).unwrap_or_else(|e| panic!("{name} arguments {args:?}: {e}"));
        let (_, p) = params.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("unknown tool {name}"));
        assert!(p.is_valid(&v), "{name} arguments {args} break its parameters");
    };
    // parallel_tool_calls: false allows one call only.
    let body = json!({"messages": [{"role": "user", "content": "Weather and time in Paris?"}], "max_tokens": 150,
        "temperature": 1.0, "seed": 3, "n": 4, "tools": tools, "tool_choice": "required", "parallel_tool_calls": false});
    for c in chat(&s, body).await["choices"].as_array().unwrap() {
        assert_eq!(c["message"]["tool_calls"].as_array().map(Vec::len), Some(1), "{c}");
    }
    let questions = ["What is the weather in Paris?", "What time is it in Tokyo?", "Tell me a joke."];
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_time"}})] {
        for (q, t) in questions.iter().zip([0.0, 1.0, 0.7]) {
            let body = json!({"messages": [{"role": "user", "content": q}], "max_tokens": 150, "temperature": t,
                "seed": 7, "tools": tools, "tool_choice": choice});
            let out = chat(&s, body.clone()).await;
            let m = &out["choices"][0]["message"];
            let calls =
                m["tool_calls"].as_array().unwrap_or_else(|| panic!("no tool call for {body}: {out}"));
            assert!(!calls.is_empty());
            for c in calls {
                assert_eq!(c["type"], "function");
                check(c["function"]["name"].as_str().unwrap(), c["function"]["arguments"].as_str().unwrap());
            }
            let named = choice.is_object();
            if named {
                assert_eq!(calls[0]["function"]["name"], "get_time");
            }
            assert_eq!(out["choices"][0]["finish_reason"], if named { "stop" } else { "tool_calls" });
            // Streamed, the same calls arrive as deltas of their arguments.
            let mut sb = body.clone();
            sb["stream"] = json!(true);
            let (status, events) = s.sse("/v1/chat/completions", &sb).await;
            assert_eq!(status, 200);
            let (streamed, finish) = streamed_calls(&events);
            assert_eq!(finish.as_deref(), out["choices"][0]["finish_reason"].as_str());
            let whole: Vec<(String, String)> = calls
                .iter()
                .map(|c| {
                    (
                        c["function"]["name"].as_str().unwrap().into(),
                        c["function"]["arguments"].as_str().unwrap().into(),
                    )
                })
                .collect();
            let parts: Vec<(String, String)> =
                streamed.iter().map(|(_, n, a)| (n.clone(), a.trim().to_string())).collect();
            assert_eq!(parts, whole, "streamed calls differ from the whole response for {body}");
            let arg_deltas = events.iter().filter(|e| e.contains("\"arguments\"")).count();
            assert!(arg_deltas > streamed.len(), "arguments came in one piece: {events:?}");
        }
    }
}

#[actix_rt::test]
async fn the_chat_template_gets_tools_and_calls_as_transformers_renders_them() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("tests/fixtures/tools/template_golden.json"))
            .expect("golden"),
    )
    .unwrap();
    let template =
        std::fs::read_to_string(common::fixture("tests/fixtures/tools/hermes_template.jinja")).unwrap();
    let s = common::server::start(&common::default_model(), |_| {}).await;
    let (status, v) = s
        .post(
            "/tokenize",
            &json!({"messages": golden["messages"], "tools": golden["tools"], "chat_template": template}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let (_, text) = s.post("/detokenize", &json!({"tokens": v["tokens"]})).await;
    assert_eq!(text["prompt"], golden["rendered"]);
}

#[actix_rt::test]
async fn reasoning_and_auto_tool_calls_are_read_from_the_output_streamed_or_not() {
    use actorllm::structured::reasoning::ReasoningParser;
    use actorllm::structured::tools::ToolParser;
    let s = common::server::start(&common::default_model(), |a| {
        a.engine.reasoning_parser = Some(ReasoningParser::DeepseekR1);
        a.engine.enable_auto_tool_choice = true;
        a.engine.tool_call_parser = Some(ToolParser::Hermes);
    })
    .await;
    // The default model has no reasoning or tool-call habits: a regex makes it write them.
    // (Its vocabulary has no single `</think>` token, so the grammar applies from the start.)
    let rx = "I should (check|ask) the time\\.</think>Sure\\.\n<tool_call>\n\\{\"name\": \"get_time\", \"arguments\": \\{\"tz\": \"(UTC|CET)\"\\}\\}\n</tool_call>";
    let body = json!({"messages": [{"role": "user", "content": "What time is it?"}], "max_tokens": 80,
        "temperature": 0, "tools": weather_tools(), "guided_regex": rx});
    let out = chat(&s, body.clone()).await;
    let m = &out["choices"][0]["message"];
    let reasoning = m["reasoning_content"].as_str().unwrap();
    assert!(reasoning.starts_with("I should ") && reasoning.ends_with(" the time."), "{out}");
    assert_eq!(m["content"], "Sure.\n", "{out}");
    let call = &m["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_time");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args == json!({"tz": "UTC"}) || args == json!({"tz": "CET"}), "{args}");
    assert_eq!(out["choices"][0]["finish_reason"], "tool_calls");
    // Streamed: reasoning deltas, then content, then the call; together the same message.
    let mut sb = body;
    sb["stream"] = json!(true);
    let (_, events) = s.sse("/v1/chat/completions", &sb).await;
    let (mut r, mut c) = (String::new(), String::new());
    let mut order = Vec::new();
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let d = &v["choices"][0]["delta"];
        for (key, acc) in [("reasoning_content", &mut r), ("content", &mut c)] {
            if let Some(t) = d[key].as_str().filter(|t| !t.is_empty()) {
                acc.push_str(t);
                if order.last() != Some(&key) {
                    order.push(key);
                }
            }
        }
        if d["tool_calls"].is_array() && order.last() != Some(&"tool_calls") {
            order.push("tool_calls");
        }
    }
    assert_eq!((r.as_str(), c.as_str()), (reasoning, "Sure.\n"));
    assert_eq!(order, ["reasoning_content", "content", "tool_calls"], "{events:?}");
    let (calls, finish) = streamed_calls(&events);
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0].1.as_str(), calls[0].2.as_str()),
        ("get_time", call["function"]["arguments"].as_str().unwrap())
    );
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    // Without a call in the output, auto gives plain content.
    let out = chat(
        &s,
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "temperature": 0,
        "tools": weather_tools(), "guided_regex": "Done\\.</think>Hello there!"}),
    )
    .await;
    let m = &out["choices"][0]["message"];
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some("Done."), Some("Hello there!"))
    );
    assert!(m.get("tool_calls").is_none_or(|c| c.is_null()), "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "stop");
}
