//! The playground in a real browser: headless Debian chromium driven by playwright-core
//! (tests/browser/playground.mjs) against a real server on the default model, served under
//! two names and with a LoRA adapter, so that the picker has choices. Screenshots land in
//! target/browser-artifacts/.
//! scripts/test.sh installs chromium and the npm package.

mod common;

use std::path::Path;

/// Runs one of tests/browser/*.mjs with `args` and checks it passed.
async fn node(script: &str, args: Vec<String>, env: Vec<(&'static str, String)>) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(Path::new(&chromium).exists(), "{chromium} missing: scripts/test.sh installs Debian's chromium");
    assert!(
        root.join("tests/browser/node_modules/playwright-core").exists(),
        "playwright-core missing: run `npm ci` in tests/browser (scripts/test.sh does)"
    );
    let script = root.join("tests/browser").join(script);
    let out = actix_rt::task::spawn_blocking(move || {
        std::process::Command::new("node").arg(script).args(args).env("CHROMIUM", chromium).envs(env).output()
    })
    .await
    .unwrap()
    .expect("node runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}");
    assert!(out.status.success(), "browser test failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"));
    stdout.into_owned()
}

/// A page served from another origin can neither open the WebSocket nor read (or even
/// start) a completion; a page of an origin given in --allowed-origins can.
#[actix_rt::test]
async fn pages_of_other_origins_cannot_use_the_server_in_chromium() {
    let s = common::server::start_tiny(5, |a| a.allowed_origins = vec!["http://friend.example".into()]).await;
    node("cross_origin.mjs", vec![s.base.clone(), "http://friend.example".into()], vec![]).await;
}

/// With --api-key the playground asks for the key, says when it is wrong, and with the
/// right one lists the models and streams over SSE and the WebSocket.
#[actix_rt::test]
async fn the_playground_takes_an_api_key_in_chromium() {
    let s = common::server::start_tiny(5, |a| a.api_key = Some("s3cret-key".into())).await;
    node("api_key.mjs", vec![s.base.clone(), "s3cret-key".into()], vec![]).await;
}

#[actix_rt::test]
async fn the_playground_streams_stops_picks_and_renders_safely_in_chromium() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let g = common::lora::golden();
    let scratch = common::scratch("browser");
    let adapter = common::lora::write_adapter(scratch.path(), &g.adapters[0].spec, false);
    let name = g.adapters[0].spec.name.clone();
    let s = common::server::start(&common::default_model(), |a| {
        a.served_model_name = vec!["SmolLM2-135M-Instruct".into(), "smollm2-alias".into()];
        a.engine.lora.enable_lora = true;
        a.engine.lora.lora_modules = vec![(name.clone(), adapter)];
    })
    .await;
    let artifacts = root.join("target/browser-artifacts");
    let args = vec![s.base.clone(), artifacts.display().to_string()];
    node("playground.mjs", args, vec![("EXPECT_ADAPTER", name)]).await;
    assert!(root.join("target/browser-artifacts/playground.png").exists(), "screenshot saved");
}
