//! `--model` as vLLM takes it: a model directory, or a Hugging Face model id
//! (`meta-llama/Meta-Llama-3-8B-Instruct`) found offline in the local Hugging Face cache as
//! `huggingface_hub` lays it out:
//!
//! ```text
//! <cache>/models--<org>--<name>/refs/<branch or tag>   the commit it points at
//! <cache>/models--<org>--<name>/snapshots/<commit>/    the files (symlinks into blobs/)
//! ```
//!
//! The caches searched, in order: `--download-dir` (vLLM hands it to `huggingface_hub` as
//! the cache directory), then `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`. Nothing is downloaded:
//! an id that is not there is an error naming every path looked in.

use std::path::{Path, PathBuf};

/// Where a model was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub dir: PathBuf,
    /// The commit of a cached snapshot; None for a plain directory.
    pub commit: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HubError {
    #[error(
        "model `{model}` is not a directory, and revision `{revision}` of it is not in the local Hugging Face \
         cache (looked in: {}). Downloading is not supported: copy the model there (for example with \
         `huggingface-cli download {model}` on a machine with network access), set HF_HOME or HF_HUB_CACHE, \
         or pass --download-dir or a directory",
        looked.join(", ")
    )]
    NotFound { model: String, revision: String, looked: Vec<String> },
    #[error(
        "--revision {revision} was given with the directory {dir}: a revision picks a cached snapshot of a model id"
    )]
    RevisionOfDirectory { revision: String, dir: String },
}

/// The caches searched for a model id, in order.
pub fn cache_dirs(download_dir: Option<&Path>) -> Vec<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let mut dirs: Vec<PathBuf> = download_dir.map(Path::to_path_buf).into_iter().collect();
    let default = env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env("XDG_CACHE_HOME").map(|x| x.join("huggingface/hub")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/huggingface/hub")));
    dirs.extend(default);
    dirs
}

/// Where models imported from other formats (GGUF files given as `--model`) are kept:
/// `actorllm-gguf/` under `--download-dir` when given, else `$XDG_CACHE_HOME/actorllm/gguf`
/// or `~/.cache/actorllm/gguf` (the temp dir when neither is set).
pub fn import_cache(download_dir: Option<&Path>) -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    match download_dir {
        Some(d) => d.join("actorllm-gguf"),
        None => env("XDG_CACHE_HOME")
            .or_else(|| env("HOME").map(|h| h.join(".cache")))
            .unwrap_or_else(std::env::temp_dir)
            .join("actorllm/gguf"),
    }
}

/// Resolves `--model` (with `--revision`, default `main`) to a directory: the path itself
/// when it is a directory, else the cached snapshot of the id in the first cache that has it.
pub fn locate(
    model: &Path,
    revision: Option<&str>,
    download_dir: Option<&Path>,
) -> Result<Located, HubError> {
    if model.is_dir() {
        if let Some(r) = revision {
            return Err(HubError::RevisionOfDirectory {
                revision: r.into(),
                dir: model.display().to_string(),
            });
        }
        return Ok(Located { dir: model.to_path_buf(), commit: None });
    }
    let id = model.to_string_lossy().into_owned();
    if !is_model_id(&id) {
        // A path that is not there: reading its config.json says so.
        return Ok(Located { dir: model.to_path_buf(), commit: None });
    }
    let revision = revision.unwrap_or("main");
    let mut looked = Vec::new();
    for cache in cache_dirs(download_dir) {
        let repo = cache.join(format!("models--{}", id.replace('/', "--")));
        if let Some(found) = snapshot(&repo, revision) {
            return Ok(found);
        }
        looked.push(repo.display().to_string());
    }
    Err(HubError::NotFound { model: id, revision: revision.into(), looked })
}

/// Whether `s` has the shape of a Hugging Face model id, `name` or `org/name` (letters,
/// digits, `-`, `_`, `.`; not starting with `.`), rather than of a path.
fn is_model_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    match s.split_once('/') {
        Some((org, name)) => part(org) && part(name),
        None => part(s),
    }
}

/// The snapshot of `revision` in one cached repository: a branch or tag under `refs/`, or a
/// commit under `snapshots/` (in full, or a prefix of at least 7 characters that only one
/// snapshot has).
fn snapshot(repo: &Path, revision: &str) -> Option<Located> {
    let in_snapshots = |commit: &str| {
        let dir = repo.join("snapshots").join(commit);
        dir.is_dir().then(|| Located { dir, commit: Some(commit.to_string()) })
    };
    let names_a_ref = !revision.is_empty() && !revision.split('/').any(|p| p.is_empty() || p == "..");
    if names_a_ref
        && let Ok(commit) = std::fs::read_to_string(repo.join("refs").join(revision))
        && let Some(found) = in_snapshots(commit.trim())
    {
        return Some(found);
    }
    if !names_a_ref || revision.contains('/') {
        return None;
    }
    if let Some(found) = in_snapshots(revision) {
        return Some(found);
    }
    if revision.len() < 7 || !revision.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut matches = std::fs::read_dir(repo.join("snapshots"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(revision));
    match (matches.next(), matches.next()) {
        (Some(commit), None) => in_snapshots(&commit),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cached repository with `main` and a tag on two commits.
    fn cache(root: &Path) -> PathBuf {
        let repo = root.join("models--org--name");
        for (commit, r) in [("aaaaaaa1111", "main"), ("bbbbbbb2222", "v1.0")] {
            std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
            std::fs::create_dir_all(repo.join("refs")).unwrap();
            std::fs::write(repo.join("refs").join(r), format!("{commit}\n")).unwrap();
        }
        repo
    }

    #[test]
    fn ids_resolve_by_branch_tag_and_commit_and_name_the_paths_looked_in() {
        let dir = crate::scratch::ScratchDir::new("hub").unwrap();
        let repo = cache(dir.path());
        let id = Path::new("org/name");
        let at = |rev: Option<&str>| locate(id, rev, Some(dir.path())).map(|l| l.dir);
        assert_eq!(at(None), Ok(repo.join("snapshots/aaaaaaa1111")));
        assert_eq!(at(Some("v1.0")), Ok(repo.join("snapshots/bbbbbbb2222")));
        assert_eq!(at(Some("bbbbbbb2222")), Ok(repo.join("snapshots/bbbbbbb2222")));
        assert_eq!(at(Some("bbbbbbb")), Ok(repo.join("snapshots/bbbbbbb2222")));
        assert!(at(Some("bbb")).is_err(), "a prefix shorter than 7 characters");
        assert!(at(Some("../../etc")).is_err());
        // Paths that are not ids are left to the config reader, whose error names the file.
        for path in ["/nonexistent/model", "./models/x", "a/b/c"] {
            assert_eq!(
                locate(Path::new(path), None, Some(dir.path())).map(|l| l.dir),
                Ok(PathBuf::from(path))
            );
        }
        let Err(HubError::NotFound { looked, .. }) = locate(Path::new("org/other"), None, Some(dir.path()))
        else {
            panic!("a missing id is an error");
        };
        assert_eq!(looked[0], dir.path().join("models--org--other").display().to_string());
        // A directory is served as it is, and a revision of one is refused.
        assert_eq!(
            at(None).and_then(|d| locate(&d, None, None).map(|l| l.dir)),
            Ok(repo.join("snapshots/aaaaaaa1111"))
        );
        assert!(matches!(locate(dir.path(), Some("main"), None), Err(HubError::RevisionOfDirectory { .. })));
    }
}
