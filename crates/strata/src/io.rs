//! Weights in safetensors, and atomic file writes.
//!
//! Owns: reading and writing a model's parameters by their PyTorch names, with every
//! mismatch (unknown or missing names, shapes, dtypes, damaged files) a clear error naming
//! the file. Must not hold training state: checkpoints of optimizer state build on this.

use crate::engine::Engine;
use crate::{Error, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use tch::{Kind, Tensor};

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one:
/// a temporary file in the same folder, flushed to disk, then renamed over the target.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| Error::Config(format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(".{}.tmp{}", name.to_string_lossy(), std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        other => return Err(Error::Model(format!("cannot store {other:?} tensors in safetensors"))),
    })
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        _ => return None,
    })
}

/// Serialises named tensors to safetensors bytes (tensors are copied to the CPU).
pub fn to_safetensors<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<Vec<u8>> {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let t = t.f_detach()?.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let mut data = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut data, t.numel())?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        owned.push((name.to_string(), dtype_of(t.kind())?, shape, data));
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
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let err = |message: String| Error::Weights { path: path.to_path_buf(), message };
    let st = SafeTensors::deserialize(&bytes).map_err(|e| err(format!("not a valid safetensors file ({e})")))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype())
            .ok_or_else(|| err(format!("tensor {name:?} has unsupported dtype {:?}", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind)?;
        out.insert(name, t);
    }
    Ok(out)
}

/// Saves the engine's parameters under their canonical names (a tied weight once).
pub fn save_weights(engine: &Engine, path: &Path) -> Result<()> {
    write_atomic(path, &to_safetensors(engine.named_params())?)
}

/// Loads parameters from a safetensors file. Every model parameter must be present (under
/// its name or an alias), every tensor in the file must name a parameter, and shapes must
/// match; dtypes are converted. Two names of one tied parameter must hold equal values.
pub fn load_weights(engine: &mut Engine, path: &Path) -> Result<()> {
    let tensors = read_safetensors(path)?;
    let err = |message: String| Error::Weights { path: path.to_path_buf(), message };
    let mut assigned: BTreeMap<usize, (&str, &Tensor)> = BTreeMap::new();
    for (name, t) in &tensors {
        let id = engine
            .spec()
            .find(name)
            .ok_or_else(|| err(format!("unknown tensor {name:?} (not a parameter of this model)")))?;
        let expected = &engine.spec().params[id.0];
        if t.size() != expected.shape {
            return Err(err(format!("{name}: shape {:?} but the model expects {:?}", t.size(), expected.shape)));
        }
        if let Some((first, earlier)) = assigned.insert(id.0, (name, t)) {
            if !earlier.f_to_kind(Kind::Double)?.f_equal(&t.f_to_kind(Kind::Double)?)? {
                return Err(err(format!("{first} and {name} differ, but the model ties them into one parameter")));
            }
        }
    }
    if let Some(missing) = engine.spec().params.iter().enumerate().find(|(i, _)| !assigned.contains_key(i)) {
        return Err(err(format!("missing parameter {:?}", missing.1.name)));
    }
    for (id, (_, t)) in assigned {
        engine.set_param(crate::model::ParamId(id), t)?;
    }
    Ok(())
}
