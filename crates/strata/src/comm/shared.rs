//! Tensors in memory that the other processes of a host can map: each allocation is a
//! memfd segment, mapped here and opened by peers through `/proc/PID/fd/FD`. A collective
//! of the `shm` backend whose buffers all live here reads its peers' data in place instead
//! of staging it through the shared arena. Nothing is left behind however processes end:
//! a memfd has no name, and its memory goes with the last mapping.
//!
//! Owns: the process's registry of such allocations and the mapping of peers' ones. Must
//! not know about collectives: the transport decides what to do with the memory.
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tch::{Kind, Tensor};

/// Where a byte range of a shared allocation is, as a peer names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Location {
    /// Unique within the owning process (never reused), so a peer's cache never confuses
    /// a freed allocation with a later one that got the same descriptor number.
    pub id: u64,
    pub fd: i32,
    pub offset: u64,
}

struct Segment {
    id: u64,
    fd: i32,
    base: usize,
    len: usize,
}

/// This process's shared allocations.
#[derive(Default)]
pub(super) struct Heap {
    next_id: AtomicU64,
    live: Mutex<Vec<Segment>>,
}

fn os_error(what: &str) -> Error {
    Error::Comm(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// Maps `len` bytes of `fd` shared and writable.
fn map(fd: i32, len: usize) -> Result<*mut u8> {
    // SAFETY: a fresh mapping of an open descriptor; the kernel checks the range.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(os_error("cannot map shared memory"));
    }
    Ok(p as *mut u8)
}

impl Heap {
    /// The process's heap.
    pub fn get() -> Arc<Heap> {
        static HEAP: OnceLock<Arc<Heap>> = OnceLock::new();
        HEAP.get_or_init(Arc::default).clone()
    }

    /// A zeroed 1-D CPU tensor whose memory peers can map; freed with its last view.
    pub fn alloc(self: &Arc<Heap>, numel: i64, kind: Kind) -> Result<Tensor> {
        let bytes = (numel.max(0) as usize * kind.elt_size_in_bytes()).max(1);
        // SAFETY: plain system calls; every failure is checked and what was made is undone.
        let fd = unsafe { libc::memfd_create(c"strata-shared".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("cannot create shared memory"));
        }
        // SAFETY: `fd` is ours.
        if unsafe { libc::ftruncate(fd, bytes as libc::off_t) } != 0 {
            let e = os_error(&format!("cannot size shared memory to {bytes} bytes"));
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let base = match map(fd, bytes) {
            Ok(p) => p,
            Err(e) => {
                unsafe { libc::close(fd) };
                return Err(e);
            }
        };
        // In the CPU allocator's statistics like any tensor, when they are kept; taken out
        // at release only if it was counted in.
        let counted = strata_ext::cpu_memory::stats().is_ok() && strata_ext::cpu_memory::account(bytes as i64).is_ok();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let base = base as usize;
        self.lock().push(Segment { id, fd, base, len: bytes });
        let heap = self.clone();
        let release = Box::new(move || {
            heap.lock().retain(|s| s.id != id);
            if counted {
                let _ = strata_ext::cpu_memory::account(-(bytes as i64));
            }
            // SAFETY: the last tensor using the mapping is gone.
            unsafe {
                libc::munmap(base as *mut libc::c_void, bytes);
                libc::close(fd);
            }
        });
        // SAFETY: the mapping holds `bytes` >= numel elements, page-aligned, zero-filled,
        // used by nothing else, and unmapped only by `release`.
        Ok(unsafe { strata_ext::from_blob(base as *mut libc::c_void, numel.max(0), kind, release) }?)
    }

    /// Where `len` bytes at `ptr` live, if they lie within one shared allocation.
    pub fn locate(&self, ptr: *const u8, len: usize) -> Option<Location> {
        let at = ptr as usize;
        self.lock().iter().find(|s| at >= s.base && at + len <= s.base + s.len).map(|s| Location {
            id: s.id,
            fd: s.fd,
            offset: (at - s.base) as u64,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Segment>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The peers' allocations this process has mapped, by (peer pid, allocation id). A peer's
/// allocation stays mapped here until the transport goes, even after its owner frees it:
/// collectives use the heap for buffers that live as long as training.
#[derive(Default)]
pub(super) struct PeerMappings {
    maps: HashMap<(i32, u64), (usize, usize)>,
}

impl PeerMappings {
    /// The address of `len` bytes at `loc` in the memory of process `pid`.
    pub fn resolve(&mut self, pid: i32, loc: Location, len: usize) -> Result<*mut u8> {
        let (base, size) = match self.maps.get(&(pid, loc.id)) {
            Some(&m) => m,
            None => {
                let path = format!("/proc/{pid}/fd/{}", loc.fd);
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| Error::Comm(format!("cannot open a peer's shared buffer {path}: {e}")))?;
                let size = file.metadata().map_err(|e| Error::Comm(format!("{path}: {e}")))?.len() as usize;
                use std::os::fd::AsRawFd;
                let base = map(file.as_raw_fd(), size)? as usize;
                self.maps.insert((pid, loc.id), (base, size));
                (base, size)
            }
        };
        let end = usize::try_from(loc.offset).ok().and_then(|offset| offset.checked_add(len));
        if end.is_none_or(|end| end > size) {
            return Err(Error::Comm(format!(
                "a peer's shared buffer holds {size} bytes, not {len} at offset {}",
                loc.offset
            )));
        }
        Ok((base + loc.offset as usize) as *mut u8)
    }
}

impl Drop for PeerMappings {
    fn drop(&mut self) {
        for &(base, size) in self.maps.values() {
            // SAFETY: mappings made by `resolve`, used by nothing once the transport goes.
            unsafe { libc::munmap(base as *mut libc::c_void, size) };
        }
    }
}
