//! Scratch directories: a fresh directory under the temp dir, removed when dropped. The
//! benchmarks write random adapters into one, and tests write models and files into their
//! own, since the tests of one binary run as threads of one process: a path named by the
//! process id alone would be shared between tests (one reading files another rewrites) and
//! reused by a later run whose process got the same id.
//!
//! Why not the tempfile crate: it brings rustix, whose `std` feature changes bitflags'
//! build, and with it actix's and gemm's, so that a test build would recompile them apart
//! from the server's build.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A directory of its owner's own, deleted with everything in it on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// A new empty directory `actorllm-{label}-{pid}-{n}` under the temp dir, with `n`
    /// counting this process's scratch directories. What an earlier process of the same id
    /// left there is removed first.
    pub fn new(label: &str) -> std::io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("actorllm-{label}-{}-{n}", std::process::id()));
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::ScratchDir;

    #[test]
    fn each_is_new_and_empty_and_goes_when_dropped() {
        let (a, b) = (ScratchDir::new("t").unwrap(), ScratchDir::new("t").unwrap());
        assert_ne!(a.path(), b.path());
        std::fs::write(a.path().join("f"), b"x").unwrap();
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists());
        assert_eq!(std::fs::read_dir(b.path()).unwrap().count(), 0);
    }
}
