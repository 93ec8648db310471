//! The official `openai` Python client, unchanged, against a real server on the default
//! model: chat and completions, plain and streaming, logprobs, n with a seed, a 404 and a
//! 400 as the client's exceptions, tool calls (forced, streamed and not, sent back with
//! their results) and a JSON schema response format. scripts/test.sh puts the package in `.venv`;
//! ACTORLLM_PYTHON names another interpreter.

mod common;

#[actix_rt::test]
async fn the_openai_python_client_works_unchanged() {
    let s = common::server::start(&common::default_model(), |_| {}).await;
    let python = std::env::var("ACTORLLM_PYTHON").unwrap_or_else(|_| {
        let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python");
        if std::path::Path::new(venv).exists() { venv.into() } else { "python3".into() }
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let base = s.base.clone();
    let out = actix_rt::task::spawn_blocking(move || {
        std::process::Command::new(&python).args([script, &base, "test-model"]).output()
    })
    .await
    .unwrap()
    .expect("python runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "openai client failed (is the `openai` package installed? scripts/test.sh installs it):\n{stdout}\n{stderr}"
    );
    // Each check prints its own line; the last counts them: all of them, and all there are.
    let summary = stdout.lines().last().unwrap_or_default();
    assert_eq!(summary, "openai client: 11 of 11 checks passed", "{stdout}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 11, "{stdout}");
}
