//! Hugging Face model folders: weights read from a folder's file or shards under its
//! family's names and layouts, and a trained model written back as such a folder
//! (`config.json`, safetensors sharded above a size with their index, tokenizer files).
use super::quantized;
use super::stacked::{self, Join, Source};
use super::{load_named, read_folder_tensors_where, write_atomic, write_safetensors_streamed};
use crate::engine::Engine;
use crate::model::hf::{
    language_model_name, release_config, release_name, Quantization, INDEX_FILE, TOKENIZER_FILES, WEIGHTS_FILE,
};
use crate::model::{DecoderHead, Family, LlamaConfig, ModelConfig, ModelDir};
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Shards hold at most this many bytes unless told otherwise (`transformers`' default, 5 GB).
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// Loads the weights of the model folder `model` into `engine` (built from `model`'s
/// config): every parameter must be present, under the family's names, in the layouts the
/// family stores (GPT-2's `Conv1D` matrices transposed back); the multi-token prediction a
/// released folder stores beside the model is left out ([`ModelDir::is_multi_token_prediction`]).
pub fn load_model_dir(engine: &mut Engine, model: &ModelDir) -> Result<()> {
    let mut named = vec![];
    let mut dequantizer = quantized::Dequantizer::new(model.quantization, engine.master_kind());
    for file in &model.weights {
        for (name, t) in read_folder_tensors_where(file, |name| !model.is_multi_token_prediction(name))? {
            let Some((name, t)) = dequantizer.take(name, t).map_err(in_file(file))? else { continue };
            let t = match &model.config {
                ModelConfig::Llama(c) if model.family.stacks_either_major() => stacked::output_major(&name, t, c.dim)?,
                _ => t,
            };
            if let Some(stacking) = model.family.expert_stacking() {
                let stack_name = model.family.renamed_from_disk(&name);
                if let Some(pieces) = stacked::unstack(&stack_name, &t, stacking)? {
                    // Each expert's parameter under the family's name (a release's prefix off).
                    for (param, piece) in pieces {
                        if let Some((param, _)) = model.family.strata_name(&param) {
                            named.push((param, name.clone(), piece));
                        }
                    }
                    continue;
                }
            }
            let Some((param, transposed)) = model.family.strata_name(&name) else { continue };
            let t = if transposed { t.f_transpose(0, 1)?.f_contiguous()? } else { t };
            named.push((param, name, t));
        }
    }
    dequantizer.finish().map_err(in_file(&model.dir))?;
    if let (Family::OlmoHybrid, ModelConfig::Llama(c)) = (model.family, &model.config) {
        recut_convolutions(&mut named, c).map_err(in_file(&model.dir))?;
    }
    let spec = engine.spec();
    let factors = super::peft::factor_ids(&spec.adapters);
    // A causal folder read as a reward model: its language head goes unused and the score
    // starts from the model's initialisation, as `transformers` builds a sequence
    // classifier from a causal checkpoint.
    let score = spec.find(SCORE).filter(|_| spec.find(LM_HEAD).is_none());
    if score.is_some() {
        named.retain(|(param, _, _)| param != LM_HEAD);
    }
    let fresh_score = score.filter(|_| !named.iter().any(|(param, _, _)| param == SCORE));
    if fresh_score.is_some() {
        tracing::info!(folder = %model.dir.display(), "the reward model's score head starts fresh");
    }
    load_named(engine, &model.dir, named.into_iter(), &|id| factors.contains(&id) || Some(id) == fresh_score)
}

/// OLMo Hybrid's convolution pieces (`linear_attn.{q,k,v}_conv1d.weight`) of each layer,
/// joined and cut again at the widths of its queries, keys and values: `transformers` 5
/// writes them cut in equal thirds (and joins them again on reading), where its releases
/// cut them at those widths.
fn recut_convolutions(named: &mut [(String, String, Tensor)], c: &LlamaConfig) -> Result<()> {
    const PIECES: [&str; 3] = ["q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"];
    let Some(l) = &c.linear_attention else { return Ok(()) };
    let widths = [l.key_heads * l.key_dim, l.key_heads * l.key_dim, l.value_heads * l.value_dim];
    // Each layer's pieces, by the module that holds them.
    let mut layers: BTreeMap<String, [Option<usize>; 3]> = BTreeMap::new();
    for (i, (param, ..)) in named.iter().enumerate() {
        let Some((module, piece)) = param.rsplit_once(".linear_attn.") else { continue };
        if let Some(at) = PIECES.iter().position(|p| *p == piece) {
            layers.entry(module.to_string()).or_default()[at] = Some(i);
        }
    }
    for (module, pieces) in layers {
        let [Some(q), Some(k), Some(v)] = pieces else {
            return Err(Error::Model(format!(
                "{module}: its convolution's queries', keys' or values' part is missing"
            )));
        };
        let whole = Tensor::f_cat(&[&named[q].2, &named[k].2, &named[v].2], 0)?;
        if whole.size()[0] != widths.iter().sum::<i64>() {
            return Err(Error::Model(format!(
                "{module}: the convolution's parts hold {} channels, not {}",
                whole.size()[0],
                widths.iter().sum::<i64>()
            )));
        }
        for (index, part) in [q, k, v].into_iter().zip(whole.f_split_with_sizes(widths, 0)?) {
            named[index].2 = part.f_contiguous()?;
        }
    }
    Ok(())
}

/// A model's error about what a file (or folder) holds, as an error naming it.
fn in_file(path: &Path) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::Model(message) => Error::Weights { path: path.to_path_buf(), message },
        other => other,
    }
}

/// A decoder's language head and a reward model's score head, by their names in its folder.
const LM_HEAD: &str = "lm_head.weight";
const SCORE: &str = "score.weight";

/// A model folder to write: where, as which family, and what goes along with the weights.
#[derive(Clone, Debug)]
pub struct FolderOut {
    /// The folder to write: filled beside it, then put in its place, keeping its other files.
    pub dir: PathBuf,
    /// The family whose parameter names and configuration the folder takes.
    pub family: Family,
    /// The model's configuration, written as the family's `config.json`.
    pub config: ModelConfig,
    /// `bos_token_id`, `eos_token_id`, `pad_token_id` for the config.
    pub special_tokens: Map<String, Value>,
    /// Tokenizer files (with its named chat templates, and a release's processor files)
    /// copied into the folder: (name there, inside it, and source).
    pub tokenizer_files: Vec<(String, PathBuf)>,
    /// A shard holds at most this many bytes (a larger parameter alone fills one).
    pub shard_bytes: u64,
    /// The release the model is the language model of, written back whole.
    pub release: Option<ReleaseOut>,
}

/// The folder of a tokenizer's named chat templates (`save_pretrained` writes one
/// `{name}.jinja` each).
const CHAT_TEMPLATES: &str = "additional_chat_templates";

/// What a release's processor reads beside the tokenizer: how images (and video) become its
/// image model's inputs, and the template of its prompts.
const PROCESSOR_FILES: [&str; 4] =
    ["preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json", "chat_template.json"];

/// A release that holds an image model beside its language model, written back whole: its
/// `config.json` around the language model's, and the tensors of its other parts carried
/// over from its files as they are.
#[derive(Clone, Debug)]
pub struct ReleaseOut {
    /// The release's `config.json`.
    pub config: Map<String, Value>,
    /// The files holding its tensors.
    pub weights: Vec<PathBuf>,
}

impl ReleaseOut {
    /// The release's tensors that are not its language model's, by name.
    /// Quantized ones are dequantized, as the language model is: the release is written back
    /// in floats, without its `quantization_config`.
    fn carried(&self) -> Result<Vec<(String, Tensor)>> {
        let scheme = Quantization::of(&self.config).map_err(Error::Config)?;
        // Exact: the image model's parameters are not Strata's to choose a kind for.
        let mut dequantizer = quantized::Dequantizer::new(scheme, Kind::Float);
        let mut carried = vec![];
        for file in &self.weights {
            for (name, t) in read_folder_tensors_where(file, |name| language_model_name(name).is_none())? {
                carried.extend(dequantizer.take(name, t).map_err(in_file(file))?);
            }
        }
        let folder = self.weights.first().and_then(|w| w.parent()).unwrap_or(Path::new("."));
        dequantizer.finish().map_err(in_file(folder))?;
        Ok(carried)
    }
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
            release: None,
        })
    }

    /// A folder for the model read from `source`, carrying its special tokens and tokenizer,
    /// and, for a release's language model, the rest of the release.
    pub fn like(dir: impl Into<PathBuf>, source: &ModelDir) -> FolderOut {
        // A reward model made of a release's language model is a classifier of its own.
        let language_model =
            matches!(source.config, ModelConfig::Llama(LlamaConfig { head: DecoderHead::LanguageModel, .. }));
        let release = source
            .release
            .clone()
            .filter(|_| language_model)
            .map(|config| ReleaseOut { config, weights: source.weights.clone() });
        let processor_files = if release.is_some() { &PROCESSOR_FILES[..] } else { &[] };
        let mut tokenizer_files: Vec<(String, PathBuf)> = TOKENIZER_FILES
            .iter()
            .chain(processor_files)
            .map(|f| (f.to_string(), source.dir.join(f)))
            .filter(|(_, p)| p.is_file())
            .collect();
        // The tokenizer's named chat templates beside its default one (a tool-use template, ...).
        let mut templates: Vec<(String, PathBuf)> = std::fs::read_dir(source.dir.join(CHAT_TEMPLATES))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|entry| entry.path().is_file())
            .map(|entry| (format!("{CHAT_TEMPLATES}/{}", entry.file_name().to_string_lossy()), entry.path()))
            .collect();
        templates.sort();
        tokenizer_files.extend(templates);
        FolderOut {
            dir: dir.into(),
            family: source.family,
            config: source.config.clone(),
            special_tokens: source.special_tokens.clone(),
            tokenizer_files,
            shard_bytes: DEFAULT_SHARD_BYTES,
            release,
        }
    }

    /// Writes the weights (as [`super::write_weights`] describes), the index, the config and
    /// the tokenizer files into a staging folder beside the target, carries over the files of
    /// the folder there now that are not weights (a model card, a generation config), and
    /// then puts the staging folder in the target's place in one rename: a crash at any
    /// point leaves the earlier folder whole, never new weights beside old ones.
    pub(super) fn write(
        &self,
        layout: &[(String, Kind, Vec<i64>)],
        fetch: impl FnMut(usize) -> Result<Tensor>,
    ) -> Result<()> {
        let name = self
            .dir
            .file_name()
            .ok_or_else(|| Error::Config(format!("{} is not a folder to write a model into", self.dir.display())))?;
        let parent = self.dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let staging = parent.join(format!(".{}.staging{}", name.to_string_lossy(), std::process::id()));
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| Error::io(&staging, e))?;
        }
        // Read before anything is written: the release may be the folder being replaced.
        let carried = match &self.release {
            Some(release) => release.carried()?,
            None => vec![],
        };
        std::fs::create_dir(&staging).map_err(|e| Error::io(&staging, e))?;
        let result = self
            .write_into(&staging, layout, fetch, carried)
            .and_then(|()| carry_other_files(&self.dir, &staging))
            .and_then(|()| replace_folder(&staging, &self.dir));
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        result
    }

    fn write_into(
        &self,
        dir: &Path,
        layout: &[(String, Kind, Vec<i64>)],
        mut fetch: impl FnMut(usize) -> Result<Tensor>,
        carried: Vec<(String, Tensor)>,
    ) -> Result<()> {
        // A release holds its language model's tensors under names of its own.
        let named = |name: String| match &self.release {
            Some(release) => release_name(&release.config, &name),
            None => name,
        };
        let mut stored: Vec<Stored> = self
            .stored(layout)?
            .into_iter()
            .map(|(name, kind, shape, source)| (named(name), kind, shape, Origin::Model(source)))
            .collect();
        stored.extend(carried.into_iter().map(|(name, t)| (name, t.kind(), t.size(), Origin::Carried(t))));
        // Parameters are fetched once each in order (a caller gathers one unit at a time);
        // a stack of experts reads some ahead of the tensors written before them, held here.
        let mut next = 0;
        let mut held: std::collections::HashMap<usize, Tensor> = Default::default();
        let mut fetch = |index: usize| -> Result<Tensor> {
            while next <= index {
                held.insert(next, fetch(next)?);
                next += 1;
            }
            held.remove(&index).ok_or_else(|| crate::Error::Model(format!("parameter {index} written twice")))
        };
        let bytes =
            |(_, kind, shape, _): &Stored| shape.iter().product::<i64>() as u64 * kind.elt_size_in_bytes() as u64;
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
            write_safetensors_streamed(&dir.join(file_name(i)), &part, &metadata, |j| {
                Ok(match &stored[range.start + j].3 {
                    Origin::Carried(t) => t.shallow_clone(),
                    Origin::Model(Source::One { index, transposed }) => {
                        let t = fetch(*index)?;
                        if *transposed {
                            t.f_transpose(0, 1)?
                        } else {
                            t
                        }
                    }
                    Origin::Model(Source::Stacked { experts, join, transpose }) => {
                        let fetched = experts
                            .iter()
                            .map(|parts| parts.iter().map(|&k| fetch(k)).collect::<Result<Vec<_>>>())
                            .collect::<Result<Vec<_>>>()?;
                        stacked::stack(fetched, *join, *transpose)?
                    }
                })
            })?;
            for (name, ..) in &part {
                weight_map.insert(name.clone(), json!(file_name(i)));
            }
        }
        if shards.len() > 1 {
            let total: u64 = stored.iter().map(bytes).sum();
            let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            write_json(&dir.join(INDEX_FILE), &index)?;
        }
        let config = self.family.config_json(&self.config, &self.special_tokens)?;
        let config = match &self.release {
            Some(release) => release_config(&release.config, config),
            None => config,
        };
        write_json(&dir.join("config.json"), &config)?;
        for (name, source) in &self.tokenizer_files {
            let bytes = std::fs::read(source).map_err(|e| Error::io(source, e))?;
            let to = dir.join(name);
            if let Some(inner) = to.parent().filter(|p| *p != dir) {
                std::fs::create_dir_all(inner).map_err(|e| Error::io(inner, e))?;
            }
            write_atomic(&to, &bytes)?;
        }
        Ok(())
    }
}

/// A tensor the folder's files hold: its name there, dtype, shape and where it comes from.
type Stored<From = Origin> = (String, Kind, Vec<i64>, From);

/// Where a tensor written comes from: the model's parameters, or a release's other parts.
enum Origin {
    Model(Source),
    Carried(Tensor),
}

impl FolderOut {
    /// The tensors the folder's files hold for parameters `layout` (name, dtype, shape): each
    /// under the family's name and layout, the experts stacked where the family stacks them.
    fn stored(&self, layout: &[(String, Kind, Vec<i64>)]) -> Result<Vec<Stored<Source>>> {
        let names: Vec<String> = layout.iter().map(|(n, ..)| n.clone()).collect();
        let sources = match self.family.expert_stacking() {
            Some(stacking) => stacked::stack_layout(&names, stacking)?,
            None => names
                .iter()
                .enumerate()
                .map(|(index, n)| (n.clone(), Source::One { index, transposed: false }))
                .collect(),
        };
        sources
            .into_iter()
            .map(|(name, source)| match source {
                Source::One { index, .. } => {
                    let (hf, transposed) = self.family.hf_name(&name);
                    let (_, kind, shape) = &layout[index];
                    let shape = if transposed { shape.iter().rev().copied().collect() } else { shape.clone() };
                    Ok((hf, *kind, shape, Source::One { index, transposed }))
                }
                Source::Stacked { ref experts, join, transpose } => {
                    let first = experts
                        .first()
                        .and_then(|parts| parts.first())
                        .ok_or_else(|| crate::Error::Model(format!("{name}: no experts to stack")))?;
                    let (_, kind, member) = &layout[*first];
                    let mut shape: Vec<i64> =
                        if transpose { member.iter().rev().copied().collect() } else { member.clone() };
                    // The parts join along the last dimension, or the first.
                    let joined = match join {
                        Join::Interleaved | Join::Columns => shape.last_mut(),
                        Join::Concatenated => shape.first_mut(),
                    };
                    if let Some(width) = joined {
                        *width *= experts[0].len() as i64;
                    }
                    shape.insert(0, experts.len() as i64);
                    Ok((self.family.hf_name(&name).0, *kind, shape, source))
                }
            })
            .collect()
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

/// Whether a file of a model folder holds weights (a single file, a shard, the index).
fn is_weights_file(name: &str) -> bool {
    let shard = name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors");
    shard || name == WEIGHTS_FILE || name == INDEX_FILE
}

/// Links (or, across file systems, copies) into `staging` whatever `dir` holds that the
/// new folder did not write and that is not weights, folders included.
fn carry_other_files(dir: &Path, staging: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name();
        let (from, to) = (entry.path(), staging.join(&name));
        if to.exists() || is_weights_file(&name.to_string_lossy()) {
            continue;
        }
        carry(&from, &to)?;
    }
    Ok(())
}

fn carry(from: &Path, to: &Path) -> Result<()> {
    if from.is_dir() {
        std::fs::create_dir(to).map_err(|e| Error::io(to, e))?;
        for entry in std::fs::read_dir(from).map_err(|e| Error::io(from, e))? {
            let entry = entry.map_err(|e| Error::io(from, e))?;
            carry(&entry.path(), &to.join(entry.file_name()))?;
        }
        return Ok(());
    }
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to).map_err(|e| Error::io(from, e))?;
    }
    Ok(())
}

/// Puts the folder `staging` where `dir` is: swapped with it in one `renameat2` where the
/// file system can exchange the two (the old folder then goes), renamed into its place
/// where there is none; elsewhere the old folder is moved aside first, so the one moment a
/// crash could leave no folder at `dir` keeps both, under their hidden names.
fn replace_folder(staging: &Path, dir: &Path) -> Result<()> {
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.exists() {
        std::fs::rename(staging, dir).map_err(|e| Error::io(dir, e))?;
        return super::sync_dir(parent);
    }
    if exchange(staging, dir).is_err() {
        let aside = staging.with_extension("old");
        std::fs::rename(dir, &aside).map_err(|e| Error::io(dir, e))?;
        std::fs::rename(staging, dir).map_err(|e| Error::io(dir, e))?;
        std::fs::rename(&aside, staging).map_err(|e| Error::io(staging, e))?;
    }
    super::sync_dir(parent)?;
    // `staging` holds the earlier folder now.
    std::fs::remove_dir_all(staging).map_err(|e| Error::io(staging, e))
}

/// Swaps two paths atomically (Linux's `renameat2` with `RENAME_EXCHANGE`).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that live across the call.
    let code =
        unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    match code {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
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
