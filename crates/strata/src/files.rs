//! Atomic file writes: a file is replaced whole or not at all, whatever crashes.
//!
//! Owns the write-to-a-temporary, flush, rename and directory sync. Must not know any file
//! format: callers hand over the bytes or a writer.
use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes).map_err(|e| Error::io(path, e)))
}

/// Writes `path` through `write` so that a crash leaves either the old file or the new
/// one: a temporary file in the same folder, flushed to disk, then renamed over the target.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&mut std::fs::File) -> Result<()>) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| Error::Config(format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(".{}.tmp{}", name.to_string_lossy(), std::process::id()));
    let result = (|| -> Result<()> {
        // Errors name the path the caller gave, not the temporary file beside it.
        let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(path, e))?;
        write(&mut f)?;
        f.sync_all().map_err(|e| Error::io(path, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Makes renames and new entries in `dir` durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))
}
