//! The official `openai` Python client, unchanged, against a real server on the default
//! model: chat and completions, plain and streaming, logprobs, a 404. scripts/test.sh puts
//! the package in `.venv`; ACTORLLM_PYTHON names another interpreter.

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
    assert!(stdout.contains("6 checks passed"), "{stdout}");
}
