//! Hugging Face model folders: weights read from a folder's file or shards under its
//! family's names and layouts, and a trained model written back as such a folder
//! (`config.json`, safetensors sharded above a size with their index, tokenizer files).
use super::{load_named, read_safetensors, tensor_bytes_le, write_atomic, write_safetensors_streamed};
use crate::engine::Engine;
use crate::model::hf::{INDEX_FILE, TOKENIZER_FILES, WEIGHTS_FILE};
use crate::model::{Family, ModelConfig, ModelDir};
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Shards hold at most this many bytes unless told otherwise (`transformers`' default, 5 GB).
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// Loads the weights of the model folder `model` into `engine` (built from `model`'s
/// config): every parameter must be present, under the family's names, in the layouts the
/// family stores (GPT-2's `Conv1D` matrices transposed back).
pub fn load_model_dir(engine: &mut Engine, model: &ModelDir) -> Result<()> {
    let mut named = vec![];
    for file in &model.weights {
        for (name, t) in read_safetensors(file)? {
            let Some((param, transposed)) = model.family.strata_name(&name) else { continue };
            let t = if transposed { t.f_transpose(0, 1)?.f_contiguous()? } else { t };
            named.push((param, name, t));
        }
    }
    load_named(engine, &model.dir, named.into_iter())
}

/// A model folder to write: where, as which family, and what goes along with the weights.
#[derive(Clone, Debug)]
pub struct FolderOut {
    pub dir: PathBuf,
    pub family: Family,
    pub config: ModelConfig,
    /// `bos_token_id`, `eos_token_id`, `pad_token_id` for the config.
    pub special_tokens: Map<String, Value>,
    /// Tokenizer files copied into the folder: (name there, source).
    pub tokenizer_files: Vec<(String, PathBuf)>,
    /// A shard holds at most this many bytes (a larger parameter alone fills one).
    pub shard_bytes: u64,
}

impl FolderOut {
    /// A folder for `config`, written as its family ([`Family::of`]), with no tokenizer.
    pub fn new(dir: impl Into<PathBuf>, config: ModelConfig) -> Result<FolderOut> {
        Ok(FolderOut {
            dir: dir.into(),
            family: Family::of(&config)?,
            config,
            special_tokens: Map::new(),
            tokenizer_files: vec![],
            shard_bytes: DEFAULT_SHARD_BYTES,
        })
    }

    /// A folder for the model read from `source`, carrying its special tokens and tokenizer.
    pub fn like(dir: impl Into<PathBuf>, source: &ModelDir) -> FolderOut {
        let tokenizer_files =
            TOKENIZER_FILES.iter().map(|f| (f.to_string(), source.dir.join(f))).filter(|(_, p)| p.is_file()).collect();
        FolderOut {
            dir: dir.into(),
            family: source.family,
            config: source.config.clone(),
            special_tokens: source.special_tokens.clone(),
            tokenizer_files,
            shard_bytes: DEFAULT_SHARD_BYTES,
        }
    }

    /// Writes the weights (as [`super::write_weights`] describes), then the index, the config
    /// and the tokenizer files; files of an earlier save that this one does not rewrite
    /// (other shards, a stale index) are removed, so the folder describes this model alone.
    pub(super) fn write(
        &self,
        layout: &[(String, Kind, Vec<i64>)],
        mut fetch: impl FnMut(usize) -> Result<Tensor>,
    ) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let stored: Vec<(String, Kind, Vec<i64>, bool)> = layout
            .iter()
            .map(|(name, kind, shape)| {
                let (hf, transposed) = self.family.hf_name(name);
                let shape = if transposed { shape.iter().rev().copied().collect() } else { shape.clone() };
                (hf, *kind, shape, transposed)
            })
            .collect();
        let bytes = |(_, kind, shape, _): &(String, Kind, Vec<i64>, bool)| {
            shape.iter().product::<i64>() as u64 * kind.elt_size_in_bytes() as u64
        };
        let shards = shard_ranges(&stored.iter().map(bytes).collect::<Vec<_>>(), self.shard_bytes);
        let file_name = |i: usize| match shards.len() {
            1 => WEIGHTS_FILE.to_string(),
            n => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
        };
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut weight_map = Map::new();
        for (i, range) in shards.iter().enumerate() {
            let part: Vec<(String, Kind, Vec<i64>)> =
                stored[range.clone()].iter().map(|(n, k, s, _)| (n.clone(), *k, s.clone())).collect();
            write_safetensors_streamed(&self.dir.join(file_name(i)), &part, &metadata, |j| {
                let t = fetch(range.start + j)?;
                tensor_bytes_le(&if stored[range.start + j].3 { t.f_transpose(0, 1)? } else { t })
            })?;
            for (name, ..) in &part {
                weight_map.insert(name.clone(), json!(file_name(i)));
            }
        }
        let written: Vec<String> = (0..shards.len()).map(file_name).collect();
        if shards.len() > 1 {
            let total: u64 = stored.iter().map(bytes).sum();
            let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            write_json(&self.dir.join(INDEX_FILE), &index)?;
        }
        remove_stale_weights(&self.dir, &written, shards.len() > 1)?;
        write_json(&self.dir.join("config.json"), &self.family.config_json(&self.config, &self.special_tokens)?)?;
        for (name, source) in &self.tokenizer_files {
            let target = self.dir.join(name);
            if target != *source {
                let bytes = std::fs::read(source).map_err(|e| Error::io(source, e))?;
                write_atomic(&target, &bytes)?;
            }
        }
        Ok(())
    }
}

/// Consecutive ranges of tensors of `sizes` bytes, each at most `limit` bytes unless one
/// tensor alone is larger.
fn shard_ranges(sizes: &[u64], limit: u64) -> Vec<std::ops::Range<usize>> {
    let mut ranges = vec![];
    let (mut start, mut held) = (0, 0);
    for (i, &size) in sizes.iter().enumerate() {
        if i > start && held + size > limit {
            ranges.push(start..i);
            (start, held) = (i, 0);
        }
        held += size;
    }
    ranges.push(start..sizes.len());
    ranges
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let mut text = serde_json::to_vec_pretty(value).map_err(|e| Error::Model(e.to_string()))?;
    text.push(b'\n');
    write_atomic(path, &text)
}

/// Removes weight files of an earlier save that this one did not write: other shards, the
/// single file or the index of the other layout.
fn remove_stale_weights(dir: &Path, written: &[String], sharded: bool) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let name = entry.map_err(|e| Error::io(dir, e))?.file_name().to_string_lossy().into_owned();
        let shard = name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors");
        let stale = (shard || name == WEIGHTS_FILE) && !written.contains(&name) || name == INDEX_FILE && !sharded;
        if stale {
            let path = dir.join(&name);
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::shard_ranges;

    #[test]
    fn shards_fill_up_to_the_limit_and_never_split_a_tensor() {
        assert_eq!(shard_ranges(&[4, 4, 4], 100), vec![0..3]);
        assert_eq!(shard_ranges(&[4, 4, 4], 8), vec![0..2, 2..3]);
        assert_eq!(shard_ranges(&[10, 1, 1], 4), vec![0..1, 1..3]);
        assert_eq!(shard_ranges(&[1, 10, 1], 4), vec![0..1, 1..2, 2..3]);
    }
}
