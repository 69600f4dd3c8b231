//! Atomic file writes: a file is replaced whole or not at all, whatever crashes.
//!
//! Owns the write-to-a-temporary, flush, rename and directory sync, and writes that bypass
//! the page cache. Must not know any file format: callers hand over the bytes, a writer or
//! a file to copy.
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

/// Copies `source` to `target` as [`write_atomic_with`] writes, by direct I/O where the
/// target's file system takes it: the device then reads the source's pages itself, so the
/// copy costs its thread almost no CPU and leaves no dirty page for the kernel to write back
/// later. That matters to a checkpoint writer sharing its cores with training. The caller
/// must not change `source` while it is copied. Returns the bytes written directly.
pub fn copy_atomic(source: &Path, target: &Path) -> Result<usize> {
    let file = std::fs::File::open(source).map_err(|e| Error::io(source, e))?;
    // SAFETY: a read-only map of a file the caller keeps unchanged while it is copied.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(source, e))?;
    let mut direct = 0;
    write_atomic_with(target, |out| {
        direct = write_direct(out, &map).map_err(|e| Error::io(target, e))?;
        Ok(())
    })?;
    Ok(direct)
}

/// Writes `path` as [`write_atomic_with`] does, through a [`DirectWriter`]: for large files
/// written once (checkpoints, exported weights), whose bytes copied into the page cache
/// would cost the writing thread more than the disk takes to write them.
pub fn write_atomic_direct(path: &Path, write: impl FnOnce(&mut DirectWriter<'_>) -> Result<()>) -> Result<()> {
    write_atomic_with(path, |file| {
        let mut out = DirectWriter::new(file).map_err(|e| Error::io(path, e))?;
        write(&mut out)?;
        out.finish().map_err(|e| Error::io(path, e))
    })
}

/// Gathers what it is given into a page-aligned buffer and writes each full buffer to its
/// file by direct I/O where the file system takes it; [`write_atomic_direct`] writes the
/// last, partial one when its closure returns.
pub struct DirectWriter<'a> {
    file: &'a mut std::fs::File,
    buffer: memmap2::MmapMut,
    filled: usize,
}

impl<'a> DirectWriter<'a> {
    fn new(file: &'a mut std::fs::File) -> std::io::Result<DirectWriter<'a>> {
        Ok(DirectWriter { file, buffer: memmap2::MmapMut::map_anon(DIRECT_PIECE)?, filled: 0 })
    }

    fn write_buffer(&mut self) -> std::io::Result<()> {
        write_direct(self.file, &self.buffer[..self.filled])?;
        self.filled = 0;
        Ok(())
    }

    /// Writes what the buffer still holds.
    fn finish(mut self) -> std::io::Result<()> {
        self.write_buffer()
    }
}

impl std::io::Write for DirectWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = bytes.len().min(self.buffer.len() - self.filled);
        self.buffer[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
        self.filled += n;
        if self.filled == self.buffer.len() {
            self.write_buffer()?;
        }
        Ok(n)
    }

    /// Nothing: a full buffer is written at once, the last when the writing ends.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The alignment direct I/O asks of addresses, lengths and offsets (the largest logical
/// block size in common use).
const DIRECT_BLOCK: usize = 4096;
/// Bytes per direct write: large enough to keep the device busy; each call pins that many
/// of the source's pages while the device reads them.
const DIRECT_PIECE: usize = 16 << 20;

/// Writes `bytes` (page-aligned, as a map is) at `out`'s position: the whole blocks by
/// direct I/O while the file system takes it (and the position is aligned), the rest through
/// the page cache. Returns the bytes written directly.
fn write_direct(out: &mut std::fs::File, bytes: &[u8]) -> std::io::Result<usize> {
    let whole = if (bytes.as_ptr() as usize).is_multiple_of(DIRECT_BLOCK) {
        bytes.len() / DIRECT_BLOCK * DIRECT_BLOCK
    } else {
        0
    };
    let mut at = 0;
    if whole > 0 && set_direct(out, true).is_ok() {
        while at < whole && at.is_multiple_of(DIRECT_BLOCK) {
            match out.write(&bytes[at..whole.min(at + DIRECT_PIECE)]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => at += n,
                // Accepted by fcntl, refused at write: this file system's direct I/O wants
                // another alignment. The page cache takes the rest.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        set_direct(out, false)?;
    }
    out.write_all(&bytes[at..])?;
    Ok(at)
}

/// Turns direct I/O on or off for `file`'s later writes.
fn set_direct(file: &std::fs::File, on: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor the file owns, with flags read from it.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let flags = if on { flags | libc::O_DIRECT } else { flags & !libc::O_DIRECT };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `path` in the page cache.
    fn cached_pages(path: &Path) -> usize {
        let file = std::fs::File::open(path).unwrap();
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let page = 4096;
        let mut resident = vec![0u8; map.len().div_ceil(page)];
        let done = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), resident.as_mut_ptr()) };
        assert_eq!(done, 0, "mincore: {}", std::io::Error::last_os_error());
        resident.iter().filter(|r| *r & 1 == 1).count()
    }

    #[test]
    fn a_copy_is_exact_and_its_whole_blocks_bypass_the_page_cache() {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let probe = dir.path().join("probe");
        let takes_direct = std::fs::File::create(&probe).map(|f| set_direct(&f, true).is_ok()).unwrap();
        for len in [0, 100, DIRECT_BLOCK, 3 * DIRECT_BLOCK + 123, DIRECT_PIECE + 5 * DIRECT_BLOCK + 7] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let (source, target) = (dir.path().join(format!("s{len}")), dir.path().join(format!("t{len}")));
            std::fs::write(&source, &bytes).unwrap();
            let direct = copy_atomic(&source, &target).unwrap();
            let cached = cached_pages(&target);
            assert!(std::fs::read(&target).unwrap() == bytes, "{len} bytes copied wrongly");
            if !takes_direct {
                eprintln!("{} takes no direct I/O: only the copy's bytes checked", dir.path().display());
                continue;
            }
            assert_eq!(direct, len / DIRECT_BLOCK * DIRECT_BLOCK, "{len} bytes");
            // Only the tail's page went through the cache (counted before the read above).
            assert!(cached <= usize::from(len % DIRECT_BLOCK != 0), "{len} bytes: {cached} pages cached");
        }
    }

    #[test]
    fn a_direct_writer_writes_every_byte_in_order_past_the_page_cache() {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let takes_direct =
            std::fs::File::create(dir.path().join("probe")).map(|f| set_direct(&f, true).is_ok()).unwrap();
        // Writes of odd sizes crossing the buffer's end, three buffers and a tail in all.
        let bytes: Vec<u8> = (0..3 * DIRECT_PIECE + 5000).map(|i| (i * 7 % 253) as u8).collect();
        let path = dir.path().join("out");
        write_atomic_direct(&path, |w| {
            for piece in bytes.chunks(1_000_003) {
                w.write_all(piece).unwrap();
            }
            Ok(())
        })
        .unwrap();
        let cached = cached_pages(&path);
        assert!(std::fs::read(&path).unwrap() == bytes, "the file differs from what was written");
        if takes_direct {
            // The three full buffers went past the cache; the tail's 5000 bytes did not.
            assert!(cached <= 2, "{cached} pages cached");
        } else {
            eprintln!("{} takes no direct I/O: only the file's bytes checked", dir.path().display());
        }
    }
}
