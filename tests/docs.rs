//! The documentation against the code: every route the server registers is in
//! docs/api.md, and every flag `actorllm serve` takes is in the README or docs/.

use clap::{Args, Command};

fn read(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The README and every page of docs/.
fn all_docs() -> String {
    let mut text = read("README.md");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            text.push_str(&std::fs::read_to_string(path).unwrap());
        }
    }
    text
}

/// Whether `text` holds `word` not followed by more of a flag's characters (`--seed`
/// is not found in `--seed-x`).
fn mentions(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        !text[i + word.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn every_route_is_in_the_api_doc() {
    let src = read("src/web/mod.rs");
    let api = read("docs/api.md");
    let routes: Vec<String> = src
        .match_indices(".route(\"")
        .map(|(i, m)| {
            let rest = &src[i + m.len()..];
            rest[..rest.find('"').unwrap()].replace("{path:.*}", "{path}")
        })
        .collect();
    assert!(routes.len() >= 10, "routes found: {routes:?}");
    let missing: Vec<&String> = routes.iter().filter(|r| !api.contains(&format!(" {r}`"))).collect();
    assert!(missing.is_empty(), "routes not in docs/api.md: {missing:?}");
}

#[test]
fn every_serve_flag_is_documented() {
    let cmd = actorllm::web::ServeArgs::augment_args(Command::new("serve"));
    let docs = all_docs();
    let flags: Vec<String> =
        cmd.get_arguments().filter_map(|a| a.get_long()).map(|l| format!("--{l}")).collect();
    assert!(flags.len() > 40, "flags found: {flags:?}");
    let missing: Vec<&String> = flags.iter().filter(|f| !mentions(&docs, f)).collect();
    assert!(missing.is_empty(), "flags of `actorllm serve` in neither the README nor docs/: {missing:?}");
}
