//! Weights in safetensors, and atomic file writes.
//!
//! Owns: reading and writing a model's parameters by their PyTorch names, as one file or as
//! a Hugging Face model folder (`folder`), with every mismatch (unknown or missing names,
//! shapes, dtypes, damaged files) a clear error naming the file. Must not hold training
//! state: checkpoints of optimizer state build on this.

mod folder;
mod peft;
mod quantized;
mod stacked;

pub use crate::files::{copy_atomic, sync_dir, write_atomic, write_atomic_with};
pub use folder::{load_model_dir, FolderOut, DEFAULT_SHARD_BYTES};
pub use peft::{
    adapter_changes_nothing, load_adapter, read_adapter_config, write_model_weights, AdapterOut, ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
};

use crate::engine::Engine;
use crate::model::{ModelSpec, ParamId};
use crate::{Error, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use tch::{Kind, Tensor};

/// What an output location will receive, for [`check_output`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A file, written atomically beside its final name.
    File,
    /// A folder the run creates if needed and writes files into.
    Folder,
}

/// Checks, before a run spends time, that `path` can receive its output: the folder exists
/// (or, for [`Output::Folder`], can be created), files can be created in it, and — where the
/// file system says — at least `bytes` are free. `flag` names the option in errors, which
/// name the path as given.
pub fn check_output(flag: &str, path: &Path, kind: Output, bytes: u64) -> Result<()> {
    let bad = |why: String| Err(Error::Config(format!("{flag} {}: {why}", path.display())));
    let folder = match kind {
        Output::File => {
            if path.is_dir() {
                return bad("is a folder, not a file".into());
            }
            if path.file_name().is_none() {
                return bad("names no file".into());
            }
            path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
        }
        Output::Folder => {
            if path.exists() && !path.is_dir() {
                return bad("is a file, not a folder".into());
            }
            if let Err(e) = std::fs::create_dir_all(path) {
                return bad(format!("cannot create the folder ({e})"));
            }
            path.to_path_buf()
        }
    };
    if !folder.is_dir() {
        return bad(format!("the folder {} does not exist", folder.display()));
    }
    // A name no other process picks, on this host or another sharing the folder.
    let probe = folder.join(format!(".strata-probe-{}", crate::comm::store::random_token()?));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
        }
        Err(e) => return bad(format!("cannot write in {} ({e})", folder.display())),
    }
    match free_bytes(&folder) {
        Some(free) if free < bytes => bad(format!("needs about {bytes} bytes, {free} are free")),
        _ => Ok(()),
    }
}

/// Bytes an unprivileged user may still write on the file system holding `dir`, if known.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct it is given and reads a valid C string.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) };
    (rc == 0).then(|| stat.f_bavail.saturating_mul(stat.f_frsize))
}

fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Uint8 => Dtype::U8,
        other => return Err(Error::Model(format!("cannot store {other:?} tensors in safetensors"))),
    })
}

pub(crate) fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::U8 => Kind::Uint8,
        _ => return None,
    })
}

/// [`kind_of`], and fp8: a model folder's quantized weights, which `quantized` restores to
/// floats (anywhere else fp8 codes would be read as values).
fn folder_kind_of(dtype: Dtype) -> Option<Kind> {
    kind_of(dtype).or(match dtype {
        Dtype::F8_E4M3 => Some(Kind::Float8e4m3fn),
        Dtype::F8_E5M2 => Some(Kind::Float8e5m2),
        _ => None,
    })
}

/// Serialises named tensors to safetensors bytes (tensors are copied to the CPU).
pub fn to_safetensors<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<Vec<u8>> {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let shape = t.size().iter().map(|&d| d as usize).collect();
        owned.push((name.to_string(), dtype_of(t.kind())?, shape, tensor_bytes_le(t)?));
    }
    let views = owned
        .iter()
        .map(|(n, d, s, b)| {
            Ok((n.as_str(), TensorView::new(*d, s.clone(), b).map_err(|e| Error::Model(e.to_string()))?))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::serialize(views, &metadata).map_err(|e| Error::Model(e.to_string()))
}

/// Reads every tensor of a safetensors file into CPU tensors, validating the file.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    read_tensors_where(path, |_| true, kind_of)
}

/// Reads the tensors of a model folder's safetensors file whose names `keep` takes into CPU
/// tensors, validating the file, fp8 ones among them; the others are never made.
pub(crate) fn read_folder_tensors_where(path: &Path, keep: impl Fn(&str) -> bool) -> Result<BTreeMap<String, Tensor>> {
    read_tensors_where(path, keep, folder_kind_of)
}

fn read_tensors_where(
    path: &Path,
    keep: impl Fn(&str) -> bool,
    kind_of: fn(Dtype) -> Option<Kind>,
) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let err = |message: String| Error::Weights { path: path.to_path_buf(), message };
    let st = SafeTensors::deserialize(&bytes).map_err(|e| err(format!("not a valid safetensors file ({e})")))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors().into_iter().filter(|(name, _)| keep(name)) {
        let kind = kind_of(view.dtype())
            .ok_or_else(|| err(format!("tensor {name:?} has unsupported dtype {:?}", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind)?;
        out.insert(name, t);
    }
    Ok(out)
}

/// A digest of the tensors in the safetensors `files`: SHA-256 over each tensor's name,
/// dtype, shape and the CRC-32C of its bytes, in name order. The same weights give the same
/// digest however they are split into files; the CRC reads gigabytes a second, where
/// hashing every byte with SHA-256 would hold up a resume of a large base.
pub fn weights_digest(files: &[std::path::PathBuf]) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut entries = BTreeMap::new();
    for path in files {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let err = |message: String| Error::Weights { path: path.to_path_buf(), message };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| err(format!("not a valid safetensors file ({e})")))?;
        for (name, view) in st.tensors() {
            let entry =
                format!("{name}\0{:?}\0{:?}\0{:08x}\n", view.dtype(), view.shape(), crc32c::crc32c(view.data()));
            if entries.insert(name.clone(), entry).is_some() {
                return Err(err(format!("tensor {name:?} is stored twice")));
            }
        }
    }
    let mut hash = Sha256::new();
    entries.values().for_each(|entry| hash.update(entry.as_bytes()));
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// A tensor's bytes as stored (little-endian, contiguous, on the CPU).
fn tensor_bytes_le(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.f_detach()?.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
    let mut data = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.f_copy_data_u8(&mut data, t.numel())?;
    Ok(data)
}

/// A safetensors header for `layout`, its length prefix included, and each tensor's size
/// in bytes. The header is padded with spaces so that the data starts 8-byte aligned.
fn safetensors_header(
    layout: &[(String, Kind, Vec<i64>)],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<usize>)> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::to_value(metadata).map_err(|e| Error::Model(e.to_string()))?);
    let mut at = 0usize;
    let mut sizes = Vec::with_capacity(layout.len());
    for (name, kind, shape) in layout {
        let len = shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
        let dtype = format!("{:?}", dtype_of(*kind)?);
        header
            .insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len]}));
        sizes.push(len);
        at += len;
    }
    let mut text = serde_json::to_vec(&header).map_err(|e| Error::Model(e.to_string()))?;
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&text);
    Ok((bytes, sizes))
}

/// Writes a safetensors file whose layout is known before its data: the header first,
/// then each tensor's values as `next` produces them (of the layout's kind and size), in
/// the header's order, copied straight into the file's bytes, written beside its name,
/// flushed to disk and renamed over it (a crash leaves the old file or the new one).
/// Whole-model saves use it so that only one unit's tensors are in memory at a time (the
/// safetensors crate serialises from a complete set of views).
pub fn write_safetensors_streamed(
    path: &Path,
    layout: &[(String, Kind, Vec<i64>)],
    metadata: &BTreeMap<String, String>,
    mut next: impl FnMut(usize) -> Result<Tensor>,
) -> Result<()> {
    let (header, sizes) = safetensors_header(layout, metadata)?;
    let io = |e| Error::io(path, e);
    crate::files::write_atomic_direct(path, |w| {
        w.write_all(&header).map_err(io)?;
        for (i, &size) in sizes.iter().enumerate() {
            let t = stored(layout, i, next(i)?, size)?.f_to_device(tch::Device::Cpu)?;
            if size > 0 {
                // SAFETY: `stored` gives a contiguous tensor of `size` bytes, here on the
                // host, alive until this slice's last use.
                let data = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, size) };
                w.write_all(data).map_err(io)?;
            }
        }
        Ok(())
    })
}

/// [`write_safetensors_streamed`]'s file written instead into the file at `path` through a
/// memory map: created (0600) where absent, else resized and overwritten where it lies, so
/// that a file kept in shared memory between saves costs one copy of each tensor into pages
/// already there; for a file nothing reads while it is written. The map is `kept`'s, an
/// earlier write's of the same file, where the caller kept one. Tensors on a GPU are copied
/// in before this returns; those `next` gives on the host are left where they lie, to be
/// copied in later by [`Deferred::fill`] (on another thread: the caller keeps them
/// unchanged until it returns).
pub fn write_safetensors_deferring(
    path: &Path,
    layout: &[(String, Kind, Vec<i64>)],
    metadata: &BTreeMap<String, String>,
    kept: Option<MappedFile>,
    mut next: impl FnMut(usize) -> Result<Tensor>,
) -> Result<Deferred> {
    let (header, sizes) = safetensors_header(layout, metadata)?;
    let mut file = map_for_writing(path, header.len() + sizes.iter().sum::<usize>(), kept)?;
    file.locking_s = 0.0;
    file.reserve(header.len())?;
    file.map[..header.len()].copy_from_slice(&header);
    let mut at = header.len();
    let mut pending = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let t = stored(layout, i, next(i)?, size)?;
        match t.device() {
            tch::Device::Cpu => pending.push((at, t)),
            _ => file.copy_in(at, &t)?,
        }
        at += size;
    }
    Ok(Deferred { file, pending })
}

/// A file mapped into memory to be written in place, kept from one write of the file to
/// the next (a snapshot in host memory rewritten at every save): its pages stay mapped,
/// and once a GPU has copied into it, page-locked, so that the device's copies land in it
/// directly. Locking costs time in proportion to the bytes, once per map.
pub struct MappedFile {
    /// The map's registration with the GPU's driver, where a GPU copied into it; dropped
    /// before the map it locks.
    locked: Option<strata_ext::cuda::HostRegistration>,
    /// The driver refused to lock the map (said once): copies into it are staged.
    refused: bool,
    /// Seconds the file's latest write spent locking the map.
    locking_s: f64,
    map: memmap2::MmapMut,
    /// The file's device and inode: the same file under another name (moved into the next
    /// snapshot's folder) keeps its map.
    identity: (u64, u64),
    /// A new file, whose pages are not yet reserved on its file system, with its path.
    unreserved: Option<(std::fs::File, std::path::PathBuf)>,
}

impl MappedFile {
    /// Bytes of the map page-locked for a GPU's copies (0 where no GPU copied into it).
    pub fn locked_bytes(&self) -> usize {
        self.locked.as_ref().map_or(0, |l| l.bytes())
    }

    /// Reserves a new file's first `bytes` (every byte where `bytes` is its length) on its
    /// file system before they are written through the map: in shared memory a write to a
    /// page with no room behind it kills the process (SIGBUS). The whole file is reserved
    /// by its first tensor's copy, not before: for a file of host values that is on the
    /// thread that fills it, off the caller's time. Where there is no room the file is
    /// removed and the error says how much was wanted where. A file system that cannot
    /// reserve ahead is written as it is.
    fn reserve(&mut self, bytes: usize) -> Result<()> {
        use std::os::fd::AsRawFd;
        let Some((file, path)) = &self.unreserved else { return Ok(()) };
        let length = libc::off_t::try_from(bytes)
            .map_err(|_| Error::Checkpoint(format!("{}: {bytes} bytes is too large a file", path.display())))?;
        // SAFETY: `file` is open for writing; posix_fallocate reads nothing else.
        let code = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, length) };
        if !matches!(code, 0 | libc::EOPNOTSUPP | libc::EINVAL) {
            let error = std::io::Error::from_raw_os_error(code);
            // The file holds nothing worth keeping yet: it goes, not to take up what room is left.
            _ = std::fs::remove_file(path);
            let folder = path.parent().unwrap_or(path).display();
            return Err(Error::Checkpoint(format!(
                "{bytes} bytes for {} do not fit in {folder}: {error}",
                path.display()
            )));
        }
        if bytes == self.map.len() {
            self.unreserved = None;
        }
        Ok(())
    }

    /// Copies `t` (contiguous) into the file's bytes from `at`, from the device it lies on;
    /// from a GPU, into the map locked first.
    fn copy_in(&mut self, at: usize, t: &Tensor) -> Result<()> {
        let bytes = t.numel() * t.kind().elt_size_in_bytes();
        if bytes == 0 {
            return Ok(());
        }
        self.reserve(self.map.len())?;
        if t.device().is_cuda() && self.locked.is_none() && !self.refused {
            let began = std::time::Instant::now();
            // SAFETY: the registration is a field of the map's owner, dropped before it.
            match unsafe { strata_ext::cuda::HostRegistration::new(self.map.as_mut_ptr(), self.map.len()) } {
                Ok(locked) => {
                    self.locked = Some(locked);
                    self.locking_s = began.elapsed().as_secs_f64();
                }
                Err(e) => {
                    self.refused = true;
                    tracing::warn!(error = %e, "host memory for the GPU's copies is not page-locked: copies are staged");
                }
            }
        }
        let target =
            self.map.get_mut(at..at + bytes).ok_or_else(|| Error::Model("a tensor past its file's end".into()))?;
        // SAFETY: a byte view of `target`, which outlives it, used only for this copy.
        let mut target =
            unsafe { Tensor::f_from_blob(target.as_mut_ptr(), &[bytes as i64], &[], Kind::Uint8, tch::Device::Cpu) }?;
        // Bytes to bytes: the copy converts nothing, and needs no alignment.
        target.f_copy_(&t.f_reshape([-1])?.f_view_dtype(Kind::Uint8)?)?;
        Ok(())
    }
}

/// The host tensors a file written by [`write_safetensors_deferring`] still lacks, and the
/// file's map to copy them into.
pub struct Deferred {
    file: MappedFile,
    /// Each tensor (contiguous, on the host) and its bytes' offset in the file.
    pending: Vec<(usize, Tensor)>,
}

impl Deferred {
    /// Bytes still to be copied in.
    pub fn bytes(&self) -> usize {
        self.pending.iter().map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }

    /// Bytes of the file's map page-locked for a GPU's copies.
    pub fn locked_bytes(&self) -> usize {
        self.file.locked_bytes()
    }

    /// Seconds this write spent locking the file's map (0 where a kept map was locked
    /// already, or nothing came from a GPU).
    pub fn locking_s(&self) -> f64 {
        self.file.locking_s
    }

    /// Copies every tensor left into the file; returns its map, for the file's next write.
    pub fn fill(mut self) -> Result<MappedFile> {
        for (at, t) in std::mem::take(&mut self.pending) {
            self.file.copy_in(at, &t)?;
        }
        Ok(self.file)
    }
}

/// Tensor `i` of `layout`, `given`, as it is stored (detached and contiguous, on the device
/// it lies on), checked against the layout's `expected` bytes.
fn stored(layout: &[(String, Kind, Vec<i64>)], i: usize, given: Tensor, expected: usize) -> Result<Tensor> {
    let t = given.f_detach()?.f_contiguous()?;
    let bytes = t.numel() * t.kind().elt_size_in_bytes();
    if bytes != expected {
        return Err(Error::Model(format!("tensor {} produced {bytes} bytes, expected {expected}", layout[i].0)));
    }
    Ok(t)
}

/// The file at `path`, created (0600) where absent, `total` bytes long, mapped for writing:
/// through `kept` where it maps this very file at this size, else anew.
fn map_for_writing(path: &Path, total: usize, kept: Option<MappedFile>) -> Result<MappedFile> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let io = |e| Error::io(path, e);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    let found = file.metadata().map_err(io)?;
    let identity = (found.dev(), found.ino());
    if let Some(kept) = kept.filter(|k| k.identity == identity && k.map.len() == total) {
        return Ok(kept);
    }
    let rewritten = found.len() == total as u64;
    file.set_len(total as u64).map_err(io)?;
    // A file rewritten at its size has its pages: they are mapped at once. A new file's are
    // reserved and allocated where first written (the values left to a deferred fill
    // there, off the caller's time): allocating them up front would stop the caller for as
    // long as the whole copy.
    let mut options = memmap2::MmapOptions::new();
    if rewritten {
        options.populate();
    }
    // SAFETY: the caller's file, which nothing else maps or resizes while it is written
    // (see `write_safetensors_deferring`); a deferred fill keeps the map until it ends.
    let map = unsafe { options.map_mut(&file) }.map_err(io)?;
    let unreserved = (!rewritten).then(|| (file, path.to_path_buf()));
    Ok(MappedFile { locked: None, refused: false, locking_s: 0.0, map, identity, unreserved })
}

/// Where whole weights are written.
#[derive(Clone, Copy, Debug)]
pub enum WeightsTarget<'a> {
    /// One safetensors file, parameters under Strata's names.
    File(&'a Path),
    /// A Hugging Face model folder.
    Folder(&'a FolderOut),
    /// A peft adapter folder (a LoRA run's adapters alone; models get them merged).
    Adapter(&'a AdapterOut),
}

/// Writes whole parameters, `layout` (Strata name, dtype, shape) in order, to `target`;
/// `fetch(i)` produces parameter `i`'s values, called once each in order, so a caller
/// can gather one unit at a time.
pub fn write_weights(
    target: WeightsTarget<'_>,
    layout: &[(String, Kind, Vec<i64>)],
    fetch: impl FnMut(usize) -> Result<Tensor>,
) -> Result<()> {
    match target {
        WeightsTarget::File(path) => {
            let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
            write_safetensors_streamed(path, layout, &metadata, fetch)
        }
        WeightsTarget::Folder(out) => out.write(layout, fetch),
        WeightsTarget::Adapter(out) => out.write(layout, fetch),
    }
}

/// Saves the whole model's parameters under their canonical names (a tied weight once,
/// adapters merged or alone as `target` says: [`write_model_weights`]), gathering one unit
/// at a time. With a sharded strategy every rank of the shard group must call this
/// together; only ranks with `write` set write.
pub fn save_weights(engine: &mut Engine, target: WeightsTarget<'_>, write: bool) -> Result<()> {
    let kind = engine.master_kind();
    // Parameters in unit order, each with its unit and offset.
    let order: Vec<(usize, ParamId, i64)> = engine
        .spec()
        .units
        .iter()
        .enumerate()
        .flat_map(|(k, u)| u.params.iter().map(move |&id| (k, id)))
        .map(|(k, id)| (k, id, engine.full_offset(id)))
        .collect();
    let layout: Vec<(ParamId, String, Kind, Vec<i64>)> = order
        .iter()
        .map(|(_, id, _)| {
            let p = &engine.spec().params[id.0];
            (*id, p.name.clone(), kind, p.shape.clone())
        })
        .collect();
    let units = engine.spec().units.len();
    if !write {
        for k in 0..units {
            drop(engine.full_unit(k)?);
        }
        return Ok(());
    }
    let adapters = engine.spec().adapters.clone();
    let mut current: Option<(usize, Tensor)> = None;
    write_model_weights(target, &adapters, &layout, |i| {
        let (unit, id, offset) = order[i];
        if current.as_ref().map(|(k, _)| *k) != Some(unit) {
            current = Some((unit, engine.full_unit(unit)?));
        }
        let (_, flat) = current.as_ref().expect("set above");
        let p = &engine.spec().params[id.0];
        Ok(flat.f_narrow(0, offset, p.numel())?.f_view(p.shape.as_slice())?)
    })
}

/// Loads parameters from a safetensors file. Every model parameter must be present (under
/// its name or an alias), every tensor in the file must name a parameter, and shapes must
/// match; dtypes are converted. Two names of one tied parameter must hold equal values.
pub fn load_weights(engine: &mut Engine, path: &Path) -> Result<()> {
    let tensors = read_safetensors(path)?;
    // A merged checkpoint also holds optimizer states, as `optim.<state>.<name>`.
    let named = tensors.into_iter().filter(|(name, _)| !name.starts_with("optim."));
    let factors = peft::factor_ids(&engine.spec().adapters);
    load_named(engine, path, named.map(|(name, t)| (name.clone(), name, t)), &|id| factors.contains(&id))
}

/// Checks, from its header alone, that the safetensors file at `path` is whole and holds
/// every parameter of `spec` under a known name and in its shape, as [`load_weights`]
/// demands: a run refuses it before spending any time (a search, a first step).
pub fn check_weights_file(spec: &ModelSpec, path: &Path) -> Result<()> {
    use std::io::Read;
    let err = |message: String| Error::Weights { path: path.to_path_buf(), message };
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| err("not a valid safetensors file (no header)".into()))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > file_len.saturating_sub(8) {
        return Err(err(format!("not a valid safetensors file (a header of {header_len} bytes in {file_len})")));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| Error::io(path, e))?;
    #[derive(serde::Deserialize)]
    struct Entry {
        shape: Vec<i64>,
        data_offsets: (u64, u64),
    }
    let mut entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| err(format!("not a valid safetensors file (header: {e})")))?;
    entries.remove("__metadata__");
    let mut shapes = Vec::new();
    for (name, value) in entries {
        let entry: Entry =
            serde_json::from_value(value).map_err(|e| err(format!("not a valid safetensors file ({name}: {e})")))?;
        let end = (8 + header_len).checked_add(entry.data_offsets.1);
        if end.is_none_or(|end| end > file_len) {
            return Err(err(format!("not a valid safetensors file ({name} lies past its end: truncated?)")));
        }
        shapes.push((name, entry.shape));
    }
    let named = shapes.iter().filter(|(name, _)| !name.starts_with("optim."));
    let factors = peft::factor_ids(&spec.adapters);
    let entries = named.map(|(name, shape)| (name.as_str(), name.as_str(), shape.as_slice()));
    match_params(spec, path, entries, &|id| factors.contains(&id))?;
    Ok(())
}

/// Matches `(parameter name, name in the source, shape)` against `spec`: every name a
/// parameter, every shape its shape, every parameter present but those `absent` allows
/// (adapters' factors beside a base model's weights, the base beside an adapter's).
/// Returns each entry's parameter, in order; errors name `source` and the source's names.
fn match_params<'a>(
    spec: &ModelSpec,
    source: &Path,
    named: impl Iterator<Item = (&'a str, &'a str, &'a [i64])>,
    absent: &dyn Fn(ParamId) -> bool,
) -> Result<Vec<ParamId>> {
    let err = |message: String| Error::Weights { path: source.to_path_buf(), message };
    let mut ids = Vec::new();
    for (name, shown, shape) in named {
        let id =
            spec.find(name).ok_or_else(|| err(format!("unknown tensor {shown:?} (not a parameter of this model)")))?;
        let expected = &spec.params[id.0].shape;
        if shape != expected.as_slice() {
            return Err(err(format!("{shown}: shape {shape:?} but the model expects {expected:?}")));
        }
        ids.push(id);
    }
    let missing = spec.params.iter().enumerate().find(|(i, _)| !ids.contains(&ParamId(*i)) && !absent(ParamId(*i)));
    if let Some(missing) = missing {
        return Err(err(format!("missing parameter {:?}", missing.1.name)));
    }
    Ok(ids)
}

/// Loads parameters from `(parameter name, name in the source, values)`, as
/// [`load_weights`] describes (parameters `absent` allows keep their values); errors name
/// `source` and the source's names.
fn load_named(
    engine: &mut Engine,
    source: &Path,
    named: impl Iterator<Item = (String, String, Tensor)>,
    absent: &dyn Fn(ParamId) -> bool,
) -> Result<()> {
    let err = |message: String| Error::Weights { path: source.to_path_buf(), message };
    let named: Vec<(String, String, Tensor)> = named.collect();
    let shapes: Vec<Vec<i64>> = named.iter().map(|(_, _, t)| t.size()).collect();
    let entries =
        named.iter().zip(&shapes).map(|((name, shown, _), shape)| (name.as_str(), shown.as_str(), shape.as_slice()));
    let ids = match_params(engine.spec(), source, entries, absent)?;
    let mut assigned: BTreeMap<ParamId, (String, Tensor)> = BTreeMap::new();
    for (id, (_, shown, t)) in ids.into_iter().zip(named) {
        if let Some((first, earlier)) = assigned.insert(id, (shown.clone(), t.shallow_clone())) {
            if !earlier.f_to_kind(Kind::Double)?.f_equal(&t.f_to_kind(Kind::Double)?)? {
                return Err(err(format!("{first} and {shown} differ, but the model ties them into one parameter")));
            }
        }
    }
    let values = assigned.into_iter().map(|(id, (_, t))| (id, t)).collect();
    engine.set_params(&values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest names the weights, not the files: the same tensors split otherwise give
    /// the same digest, one changed element or another name another.
    #[test]
    fn the_weights_digest_follows_the_tensors_not_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (Tensor::from_slice(&[1.0f32, 2.0, 3.0]), Tensor::from_slice(&[4i64, 5]));
        let write = |name: &str, tensors: &[(&str, &Tensor)]| {
            let path = dir.path().join(name);
            std::fs::write(&path, to_safetensors(tensors.iter().copied()).unwrap()).unwrap();
            path
        };
        let whole = weights_digest(&[write("whole", &[("a", &a), ("b", &b)])]).unwrap();
        let split = weights_digest(&[write("b", &[("b", &b)]), write("a", &[("a", &a)])]).unwrap();
        assert_eq!(whole, split);
        let changed = Tensor::from_slice(&[1.0f32, 2.0, 3.5]);
        assert_ne!(whole, weights_digest(&[write("changed", &[("a", &changed), ("b", &b)])]).unwrap());
        assert_ne!(whole, weights_digest(&[write("renamed", &[("c", &a), ("b", &b)])]).unwrap());
        let twice = weights_digest(&[write("one", &[("a", &a)]), write("two", &[("a", &a)])]);
        assert!(twice.unwrap_err().to_string().contains("stored twice"));
    }

    /// A new file written in place with its host values deferred holds no memory for them
    /// until the fill writes them (a snapshot's first save does not wait for its pages to
    /// be allocated), then reads back as written; rewritten, it reads back the new values.
    #[test]
    fn a_deferred_file_allocates_its_pages_where_they_are_written() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            eprintln!("a_deferred_file_allocates_its_pages_where_they_are_written: skipped, no /dev/shm");
            return;
        };
        let path = dir.path().join("snapshot.safetensors");
        let values = Tensor::arange(1 << 20, (Kind::Float, tch::Device::Cpu));
        let layout = [("values".to_string(), Kind::Float, vec![1 << 20])];
        let allocated = || std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&path).unwrap()) * 512;
        for scale in [1.0, 2.0] {
            let stored = values.f_mul_scalar(scale).unwrap();
            let deferred =
                write_safetensors_deferring(&path, &layout, &BTreeMap::new(), None, |_| Ok(stored.shallow_clone()))
                    .unwrap();
            assert_eq!(deferred.bytes(), 4 << 20);
            if scale == 1.0 {
                assert!(allocated() < 1 << 20, "{} bytes allocated before the fill", allocated());
            }
            deferred.fill().unwrap();
            assert!(allocated() >= 4 << 20, "{} bytes allocated after the fill", allocated());
            let read = read_safetensors(&path).unwrap();
            assert!(read["values"].equal(&stored), "scale {scale}");
        }
    }

    /// A snapshot file's map serves its next write, under the file's new name too; another
    /// file at the name, or the file at another size, gets a map of its own; and every
    /// write reads back as written, the bytes of a tensor whatever their alignment. (That
    /// the map is kept, not made again, shows on a GPU: its pages are locked once, in
    /// `compute`'s CUDA tests.)
    #[test]
    fn a_kept_map_writes_its_own_file_again_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let (first, moved) = (dir.path().join("first"), dir.path().join("moved"));
        // A one-byte tensor first leaves the floats after it unaligned in the map.
        let write = |path: &Path, n: i64, scale: f64, kept: Option<MappedFile>| {
            let byte = Tensor::from_slice(&[7u8]);
            let values = Tensor::arange(n, (Kind::Float, tch::Device::Cpu)).f_mul_scalar(scale).unwrap();
            let layout = [("byte".to_string(), Kind::Uint8, vec![1]), ("values".to_string(), Kind::Float, vec![n])];
            let given = [byte.shallow_clone(), values.shallow_clone()];
            let deferred =
                write_safetensors_deferring(path, &layout, &BTreeMap::new(), kept, |i| Ok(given[i].shallow_clone()))
                    .unwrap();
            let file = deferred.fill().unwrap();
            let read = read_safetensors(path).unwrap();
            assert!(read["values"].equal(&values) && read["byte"].equal(&byte), "{} at scale {scale}", path.display());
            file
        };
        let kept = write(&first, 1000, 1.0, None);
        std::fs::rename(&first, &moved).unwrap();
        let kept = write(&moved, 1000, 2.0, Some(kept));
        // The same size, another file: the kept map would write the one it replaced.
        std::fs::copy(&moved, &first).unwrap();
        std::fs::rename(&first, &moved).unwrap();
        let kept = write(&moved, 1000, 3.0, Some(kept));
        // The same file at another size.
        let kept = write(&moved, 3000, 4.0, Some(kept));
        assert_eq!(kept.map.len() as u64, std::fs::metadata(&moved).unwrap().len());
        assert_eq!(kept.locked_bytes(), 0, "nothing came from a GPU");
    }

    /// A file larger than the room left in its shared memory is refused with an error and
    /// leaves nothing behind, where writing through its map would kill the process
    /// (SIGBUS); one that fits is written. It runs again in a private mount namespace over
    /// a tmpfs of 1 MiB (`unshare`, as root); without them it says it is skipped.
    #[test]
    fn a_file_larger_than_its_shared_memory_is_refused_not_fatal() {
        const NAME: &str = "io::tests::a_file_larger_than_its_shared_memory_is_refused_not_fatal";
        const SMALL_TMPFS: &str = "STRATA_TEST_SMALL_TMPFS";
        let write = |path: &Path, n: i64| {
            let values = Tensor::arange(n, (Kind::Float, tch::Device::Cpu));
            let layout = [("values".to_string(), Kind::Float, vec![n])];
            let deferred =
                write_safetensors_deferring(path, &layout, &BTreeMap::new(), None, |_| Ok(values.shallow_clone()))?;
            deferred.fill()?;
            let read = read_safetensors(path)?;
            assert!(read["values"].equal(&values), "{} read back", path.display());
            Ok::<(), Error>(())
        };
        if let Some(folder) = std::env::var_os(SMALL_TMPFS) {
            let path = Path::new(&folder).join("rank-0.safetensors");
            let error = write(&path, 1 << 20).expect_err("4 MiB of floats written into 1 MiB").to_string();
            assert!(error.contains("do not fit in") && error.contains("No space left"), "{error}");
            assert!(!path.exists(), "the file that did not fit was left behind");
            write(&path, 1 << 16).unwrap();
            return;
        }
        let namespaces =
            std::process::Command::new("unshare").args(["-m", "--propagation", "private", "true"]).output();
        if !namespaces.is_ok_and(|o| o.status.success()) {
            eprintln!("{NAME}: skipped, no private mount namespace (unshare -m, as root)");
            return;
        }
        let folder = tempfile::tempdir().unwrap();
        let exe = std::env::current_exe().unwrap();
        let script = format!(
            "mount -t tmpfs -o size=1m none '{}' || exit 77; exec '{}' --exact {NAME} --nocapture --test-threads 1",
            folder.path().display(),
            exe.display()
        );
        let o = std::process::Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c", &script])
            .env(SMALL_TMPFS, folder.path())
            .output()
            .unwrap();
        if o.status.code() == Some(77) {
            eprintln!("{NAME}: skipped, no tmpfs could be mounted");
            return;
        }
        let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && out.contains("1 passed"), "{:?}:\n{out}", o.status);
    }
}
