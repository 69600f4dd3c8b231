//! The data loader: rows of `ctx` positions — windows of `ctx + 1` tokens cut from a
//! [`TokenData`], or one example of an [`ExampleSet`] each, padded — grouped into global
//! batches, split across ranks and into micro-batches, built on a background thread.
//!
//! Owns the order of the rows and the making of batches. Must not tokenise or read
//! datasets (a [`Dataset`] arrives as tokens), nor know models: a batch is token tensors.
use super::synthetic::SplitMix64;
use super::{Dataset, ExampleSet, RowSet, DATASETS_MAP_BATCH};
use crate::model::layers::IGNORE;
use crate::model::{RowLayout, SequencePiece};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use tch::{Device, Kind, Tensor};

/// An exact replay of another run's batches: row `b` of step `s` is
/// `tokens[offsets[s][b] .. offsets[s][b] + ctx]`, its targets shifted by one (of examples,
/// example number `offsets[s][b]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchOffsets {
    /// Positions per row; must equal the run's `ctx`.
    pub ctx: usize,
    /// Rows per step over all ranks; must equal the run's batch size.
    pub batch: usize,
    /// Each step's rows: a token offset per row (an example number for examples).
    pub offsets: Vec<Vec<usize>>,
}

impl BatchOffsets {
    /// Reads a batch-offsets JSON file, refusing one with a step of other than `batch` offsets.
    pub fn from_file(path: &Path) -> Result<BatchOffsets> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let parsed: BatchOffsets = serde_json::from_str(&text)
            .map_err(|e| Error::Data(format!("{}: not a batch-offsets file ({e})", path.display())))?;
        if let Some((s, row)) = parsed.offsets.iter().enumerate().find(|(_, r)| r.len() != parsed.batch) {
            return Err(Error::Data(format!(
                "{}: step {s} has {} offsets but batch is {}",
                path.display(),
                row.len(),
                parsed.batch
            )));
        }
        Ok(parsed)
    }
}

/// Which windows each step takes.
#[derive(Clone, Debug)]
pub enum Order {
    /// Non-overlapping windows, reshuffled every epoch with the loader's seed (each epoch
    /// also shifts where windows start, so every alignment is eventually seen); examples,
    /// reshuffled every epoch.
    Shuffled,
    /// Exactly the given offsets; the loader ends when they run out.
    Offsets(BatchOffsets),
}

/// How a job cuts its data into optimizer steps, the same on every rank: a run's
/// configuration holds it, `auto_accelerate` takes it as its `dataloader_args`, and each
/// rank's [`LoaderConfig`] adds the rank's place to it.
#[derive(Clone, Debug)]
pub struct Batching {
    /// Positions per row.
    pub ctx: usize,
    /// Rows per optimizer step over all ranks (the global batch).
    pub batch_size: usize,
    /// Micro-batches per step on each rank (gradient accumulation).
    pub accumulation: usize,
    /// Seeds the order of the rows (and a run's parameter initialisation).
    pub seed: u64,
    /// Which windows each step takes.
    pub order: Order,
    /// Pack several examples into each row (examples only), each seeing only itself.
    pub pack: bool,
    /// How packed rows are filled.
    pub pack_strategy: PackStrategy,
}

/// How examples fill packed rows (TRL's `packing_strategy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PackStrategy {
    /// Each epoch's shuffled examples in turn, a row taking them while the next fits: rows
    /// differ every epoch.
    #[default]
    InOrder,
    /// Rows made once as TRL's `bfd` makes them ([`best_fit_rows`]), shuffled every epoch:
    /// fewer rows, less padding.
    BestFit,
}

impl std::str::FromStr for PackStrategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<PackStrategy> {
        match s {
            "in-order" => Ok(PackStrategy::InOrder),
            "bfd" => Ok(PackStrategy::BestFit),
            other => Err(Error::Config(format!("packing strategy {other:?}: expected in-order or bfd"))),
        }
    }
}

/// Rows of at most `ctx` tokens, each the examples (by index) it holds in its order, packed
/// as TRL's `pack_dataset(strategy="bfd")` packs examples of these `lengths` (each at most
/// `ctx`): within each run of [`DATASETS_MAP_BATCH`] examples, longest first (ties in their
/// order), each into the row with the least room that holds it (the earliest of those
/// rows), or a new row; rows in the order they were opened. Empty examples are left out.
pub fn best_fit_rows(lengths: &[usize], ctx: usize) -> Vec<Vec<usize>> {
    let mut rows: Vec<Vec<usize>> = vec![];
    for (run, chunk) in lengths.chunks(DATASETS_MAP_BATCH).enumerate() {
        // Cut to the row first: examples longer than it tie with those that fill it.
        let chunk: Vec<usize> = chunk.iter().map(|&l| l.min(ctx)).collect();
        let mut order: Vec<usize> = (0..chunk.len()).filter(|&i| chunk[i] > 0).collect();
        order.sort_by(|&a, &b| chunk[b].cmp(&chunk[a]));
        // Rows of this run with room left, by that room, earliest first.
        let mut with_room: std::collections::BTreeMap<usize, std::collections::VecDeque<usize>> = Default::default();
        for i in order {
            let length = chunk[i];
            // Only rooms that some row has are kept, so the first found holds a row.
            let found = with_room.range_mut(length..).next().and_then(|(&room, rows)| Some((room, rows.pop_front()?)));
            let (room, row) = match found {
                Some((room, row)) => {
                    if with_room.get(&room).is_some_and(|r| r.is_empty()) {
                        with_room.remove(&room);
                    }
                    (room, row)
                }
                None => {
                    rows.push(vec![]);
                    (ctx, rows.len() - 1)
                }
            };
            rows[row].push(run * DATASETS_MAP_BATCH + i);
            if room > length {
                with_room.entry(room - length).or_default().push_back(row);
            }
        }
    }
    rows
}

impl Batching {
    /// Global batches of `batch_size` rows of `ctx` positions, one micro-batch per step,
    /// shuffled with seed 0.
    pub fn new(ctx: usize, batch_size: usize) -> Batching {
        Batching {
            ctx,
            batch_size,
            accumulation: 1,
            seed: 0,
            order: Order::Shuffled,
            pack: false,
            pack_strategy: PackStrategy::InOrder,
        }
    }
}

impl Default for Batching {
    /// 16 rows of 64 positions per step.
    fn default() -> Self {
        Batching::new(64, 16)
    }
}

/// One rank's loader: the job's [`Batching`] and the rank's place.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// The job's batching, the same on every rank.
    pub batching: Batching,
    /// This rank's share of the batch among `world` data replicas.
    pub rank: usize,
    /// Data replicas the batch is split among.
    pub world: usize,
    /// Steps built ahead on the background thread.
    pub prefetch: usize,
    /// Where the batches' tensors are placed.
    pub device: Device,
    /// Index of the first step to produce: a resumed run continues where it stopped.
    pub start_step: usize,
    /// Under context parallelism, this rank's piece of every row's positions: each
    /// micro-batch keeps those alone (`None`: whole rows).
    pub context: Option<SequencePiece>,
}

impl LoaderConfig {
    /// The loader of one process (the whole batch) on the CPU.
    pub fn new(batching: Batching) -> Self {
        LoaderConfig { batching, rank: 0, world: 1, prefetch: 2, device: Device::Cpu, start_step: 0, context: None }
    }

    /// Rows of one micro-batch on this rank.
    pub fn micro_batch_rows(&self) -> Result<usize> {
        if self.batching.ctx == 0 || self.batching.batch_size == 0 || self.batching.accumulation == 0 || self.world == 0
        {
            return Err(Error::Config("ctx, batch size, accumulation and world size must be positive".into()));
        }
        if self.rank >= self.world {
            return Err(Error::Config(format!("rank {} is outside a world of {}", self.rank, self.world)));
        }
        let per_rank = self.batching.batch_size / self.world;
        if !self.batching.batch_size.is_multiple_of(self.world) || !per_rank.is_multiple_of(self.batching.accumulation)
        {
            return Err(Error::Config(format!(
                "batch size {} does not split into {} ranks × {} micro-batches",
                self.batching.batch_size, self.world, self.batching.accumulation
            )));
        }
        Ok(per_rank / self.batching.accumulation)
    }
}

/// Inputs and next-token targets, both `[rows, ctx]` int64.
pub struct Batch {
    /// `[rows, ctx]` token ids the model reads.
    pub inputs: Tensor,
    /// What the loss compares the model's output with: the next token at each position
    /// (or [`IGNORE`] where no loss is taken), or, for a classifier, a label per row.
    pub targets: Tensor,
    /// How many targets are not [`IGNORE`]: the tokens this micro-batch's loss averages over.
    pub supervised: u64,
    /// Where rows hold several examples (packing) or padding: which example each position
    /// belongs to (and, for an encoder, the token types).
    pub layout: Option<RowLayout>,
    /// `[rows, ctx]` bool, true at the padding after a row's examples (what `transformers`
    /// hides with `attention_mask`): a mixture of experts' routing statistics leave it out.
    /// `None` where no row is padded.
    pub padding: Option<Tensor>,
    /// The number of this batch's first row among its step's global batch (the rows of
    /// every rank and micro-batch, in order): dropout masks are drawn by it, so however the
    /// batch is split, each row draws the same masks.
    pub first_row: usize,
    /// Preference pairs' reference log-probabilities, one per row (`[rows]`, fp64), where
    /// they were computed: what the preference loss measures the policy's against.
    pub reference: Option<Tensor>,
    /// Unpaired preferences (KTO's): whether each record's completion is desirable
    /// (`[rows / 2]`, bool).
    pub desirable: Option<Tensor>,
    /// Reward pairs: how far each pair's chosen reward should exceed its rejected one
    /// (`[rows / 2]`, fp32), where the records give a `"margin"`.
    pub margin: Option<Tensor>,
    /// GRPO's completions: their advantages and the log-probabilities their loss measures
    /// the policy's against.
    pub rollout: Option<RolloutScores>,
}

/// What a GRPO micro-batch's loss reads beside its rows ([`crate::grpo`]).
pub struct RolloutScores {
    /// Each row's advantage (`[rows]`, fp32).
    pub advantages: Tensor,
    /// Each position's log-probability of its target under the policy that generated the
    /// completions (`[rows, ctx]`, fp32), where an update reuses an older generation batch;
    /// `None`: the policy's own, detached (a ratio of 1).
    pub old: Option<Tensor>,
    /// The same under the reference model, where the KL term is on.
    pub reference: Option<Tensor>,
    /// What the token sum is divided by where the loss is normalised over the step's
    /// completion tokens (dapo, cispo, vespo): every rank's generation batch's tokens (at
    /// least one), over the ranks and the micro-batches per generation (the trainer's
    /// weight of each micro-batch, one over the accumulation, completes TRL's window).
    pub token_normalizer: f64,
}

impl RolloutScores {
    fn to_device(&self, device: Device) -> Result<RolloutScores> {
        let moved = |t: &Option<Tensor>| t.as_ref().map(|t| t.f_to_device(device)).transpose();
        Ok(RolloutScores {
            advantages: self.advantages.f_to_device(device)?,
            old: moved(&self.old)?,
            reference: moved(&self.reference)?,
            token_normalizer: self.token_normalizer,
        })
    }
}

impl Batch {
    /// A batch whose supervised targets are counted from `targets` (a read of the tensor).
    pub fn new(inputs: Tensor, targets: Tensor) -> Result<Batch> {
        let supervised = targets.f_ne(IGNORE)?.f_sum(Kind::Int64)?.f_int64_value(&[])? as u64;
        Ok(Batch {
            inputs,
            targets,
            supervised,
            layout: None,
            padding: None,
            first_row: 0,
            reference: None,
            desirable: None,
            margin: None,
            rollout: None,
        })
    }

    /// This batch's `piece` of every row's positions (context parallelism): its inputs,
    /// targets and padding there, and a layout that places each position in its row (its
    /// place, or its place within its example where rows are packed) and its example.
    pub fn piece(&self, piece: &SequencePiece) -> Result<Batch> {
        if self.targets.size() != self.inputs.size() {
            return Err(Error::Config(
                "context_parallel: the rows' targets are not one per position (a classifier's), so the rows do not \
                 split"
                    .into(),
            ));
        }
        let take = |t: &Tensor| piece.take(t, 1);
        let layout = match &self.layout {
            Some(RowLayout { source_len: Some(_), .. }) => {
                return Err(Error::Config(
                    "context_parallel: rows of a source and its target (an encoder–decoder's) do not split".into(),
                ))
            }
            Some(l) => RowLayout {
                positions: take(&l.positions)?,
                examples: take(&l.examples)?,
                segments: l.segments.as_ref().map(take).transpose()?,
                source_len: None,
            },
            None => {
                let (rows, len) = (self.inputs.size()[0], self.inputs.size()[1]);
                let places = piece.places(len, self.inputs.device())?;
                let positions = places.f_unsqueeze(0)?.f_expand([rows, -1], false)?.f_contiguous()?;
                RowLayout { examples: positions.f_zeros_like()?, positions, segments: None, source_len: None }
            }
        };
        let mut batch = Batch::new(take(&self.inputs)?, take(&self.targets)?)?;
        batch.layout = Some(layout);
        batch.padding = self.padding.as_ref().map(take).transpose()?;
        batch.first_row = self.first_row;
        Ok(batch)
    }

    /// The same batch on `device`.
    pub fn to_device(&self, device: Device) -> Result<Batch> {
        Ok(Batch {
            inputs: self.inputs.f_to_device(device)?,
            targets: self.targets.f_to_device(device)?,
            supervised: self.supervised,
            layout: self.layout.as_ref().map(|l| l.to_device(device)).transpose()?,
            padding: self.padding.as_ref().map(|p| p.f_to_device(device)).transpose()?,
            first_row: self.first_row,
            reference: self.reference.as_ref().map(|r| r.f_to_device(device)).transpose()?,
            desirable: self.desirable.as_ref().map(|r| r.f_to_device(device)).transpose()?,
            margin: self.margin.as_ref().map(|r| r.f_to_device(device)).transpose()?,
            rollout: self.rollout.as_ref().map(|r| r.to_device(device)).transpose()?,
        })
    }
}

/// One optimizer step's data on this rank.
pub struct Step {
    /// The step's number, counting from 0.
    pub index: usize,
    /// The rank's micro-batches, run one after another before the update.
    pub micro_batches: Vec<Batch>,
    /// Supervised targets in the whole global batch: every micro-batch of every rank.
    pub global_supervised: u64,
    /// Ranks the global batch is split across (their gradients are averaged).
    pub data_ranks: usize,
}

impl Step {
    /// A step of one process: the global batch is these micro-batches.
    pub fn new(index: usize, micro_batches: Vec<Batch>) -> Step {
        let global_supervised = micro_batches.iter().map(|b| b.supervised).sum();
        Step { index, micro_batches, global_supervised, data_ranks: 1 }
    }

    /// What micro-batch `i`'s mean loss is multiplied by before backward, so that the step's
    /// gradient (averaged over the data ranks) is that of the sum of every supervised
    /// token's loss in the global batch divided by their count: each token weighs the same
    /// however the tokens fall into micro-batches and ranks. Full windows give `1 / micro-batches`.
    pub fn loss_weight(&self, i: usize) -> f64 {
        match self.global_supervised {
            0 => 0.0,
            all => (self.micro_batches[i].supervised * self.data_ranks as u64) as f64 / all as f64,
        }
    }
}

/// Validation steps: `count` global batches of consecutive windows (or examples) from the
/// start of `data`, none overlapping, each split over ranks and micro-batches as `config` says (its
/// seed, order and start play no part), so every evaluation reads the same tokens. `None`
/// takes as many whole batches as fit, at most `most`.
pub fn validation_steps(data: &Dataset, config: &LoaderConfig, count: Option<usize>, most: usize) -> Result<Vec<Step>> {
    let rows = config.micro_batch_rows()?;
    // Packed rows are filled from the first example on, in order (or best fit, in the order
    // the rows were opened).
    let packed = match data {
        Dataset::Examples(e) if config.batching.pack => Some(match config.batching.pack_strategy {
            PackStrategy::InOrder => pack(&mut (0..e.len()).peekable(), &lengths(e), config.batching.ctx),
            PackStrategy::BestFit => best_fit_rows(&lengths(e), config.batching.ctx),
        }),
        _ => None,
    };
    let (held, what, stride) = match (data, &packed) {
        (_, Some(packed)) => (packed.len(), format!("packed rows of {} tokens", config.batching.ctx), 0),
        (Dataset::Tokens(t), None) => (
            t.len().saturating_sub(1) / config.batching.ctx,
            format!("windows of {} tokens", config.batching.ctx + 1),
            config.batching.ctx,
        ),
        (Dataset::Examples(e), None) => (e.len(), "examples".to_string(), 1),
        (Dataset::Labeled(l), None) => (l.len(), "labeled texts".to_string(), 1),
        (Dataset::SourceTarget(s), None) => (s.len(), "sources with targets".to_string(), 1),
        (Dataset::Masked(m), None) => (m.len(), format!("masked rows of {} tokens", m.longest()), 1),
        (Dataset::Preference(p), None) => (p.len(), "preference pairs".to_string(), 1),
        (Dataset::Prompts(p), None) => (p.len(), "prompts".to_string(), 1),
    };
    let fit = held / config.batching.batch_size;
    let count = match count {
        Some(c) if c > fit => {
            return Err(Error::Data(format!(
                "{} holds {held} {what}: {c} validation batches of {} need {}",
                data.source(),
                config.batching.batch_size,
                c * config.batching.batch_size
            )))
        }
        Some(c) => c,
        None => fit.min(most),
    };
    if count == 0 {
        return Err(Error::Data(format!(
            "{} ({held} {what}) holds no whole validation batch of {}",
            data.source(),
            config.batching.batch_size,
        )));
    }
    (0..count)
        .map(|i| {
            let batch = i * config.batching.batch_size..(i + 1) * config.batching.batch_size;
            let global: Vec<Vec<usize>> = match &packed {
                Some(packed) => packed[batch].to_vec(),
                None => batch.map(|r| vec![r * stride]).collect(),
            };
            build_step(data, config, rows, i, &global)
        })
        .collect()
}

/// Iterator over [`Step`]s, produced on a background thread.
pub struct DataLoader {
    rx: Option<Receiver<Result<Step>>>,
    worker: Option<JoinHandle<()>>,
}

impl DataLoader {
    /// Starts the background thread that builds the steps from `config.start_step` on; refuses
    /// data that holds no row.
    pub fn new(data: Arc<Dataset>, config: LoaderConfig) -> Result<DataLoader> {
        let rows = config.micro_batch_rows()?;
        match data.as_ref() {
            Dataset::Tokens(t) => t.check_length(config.batching.ctx)?,
            Dataset::Examples(e) if e.is_empty() => return Err(Error::Data(format!("{} holds no example", e.source))),
            Dataset::Examples(_) => {}
            Dataset::Labeled(_)
            | Dataset::SourceTarget(_)
            | Dataset::Masked(_)
            | Dataset::Preference(_)
            | Dataset::Prompts(_) => match data.row_set() {
                Some(rows) if rows.is_empty() => return Err(Error::Data(format!("{} holds no record", rows.source()))),
                _ => {}
            },
        }
        let mut offsets = OffsetStream::new(&data, &config)?;
        // Skipped steps only advance the order: no batch is built for them.
        for _ in 0..config.start_step {
            offsets.next_step();
        }
        let (tx, rx) = sync_channel(config.prefetch.max(1));
        let worker = std::thread::Builder::new()
            .name("strata-data".into())
            .spawn(move || {
                for index in config.start_step.. {
                    let Some(global) = offsets.next_step() else { break };
                    let step = build_step(&data, &config, rows, index, &global);
                    let failed = step.is_err();
                    // A closed channel means the loader was dropped: stop quietly.
                    if tx.send(step).is_err() || failed {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Data(format!("cannot start the data thread: {e}")))?;
        Ok(DataLoader { rx: Some(rx), worker: Some(worker) })
    }
}

impl Iterator for DataLoader {
    type Item = Result<Step>;
    fn next(&mut self) -> Option<Result<Step>> {
        self.rx.as_ref()?.recv().ok()
    }
}

impl Drop for DataLoader {
    fn drop(&mut self) {
        self.rx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The global batch's window offsets (or example numbers), step after step.
struct OffsetStream {
    order: Order,
    ctx: usize,
    batch: usize,
    items: Items,
    rng: SplitMix64,
    epoch: Epoch,
    cursor: usize,
    /// A packed row's first example, drawn while filling the row before it.
    waiting: Option<usize>,
    step: usize,
}

/// What an epoch passes over.
enum Items {
    /// Windows of a token stream of this many tokens.
    Windows { tokens: usize },
    /// This many examples, one a row.
    Examples { count: usize },
    /// Examples of these lengths, packed into rows of `ctx` tokens (shared, not copied, by
    /// each row's filling).
    Packed { lengths: Arc<[usize]> },
    /// Rows packed once, each the examples it holds.
    Rows { rows: Arc<[Vec<usize>]> },
}

/// One pass over the windows of a shift: window `k` of the pass starts at
/// `shift + ctx · order.at(k)` (example `order.at(k)` of examples). The order is computed, not stored, so a pass over a corpus
/// of any size costs no memory.
struct Epoch {
    shift: usize,
    order: Permutation,
}

/// A seeded bijection of `0..count`: a four-round Feistel network over the smallest domain
/// of an even number of bits that holds `count`, walked until it lands below `count`
/// (the domain is at most four times `count`, so a few steps on average).
struct Permutation {
    count: u64,
    half_bits: u32,
    keys: [u64; 4],
}

impl Permutation {
    fn new(count: u64, rng: &mut SplitMix64) -> Permutation {
        let bits = (64 - count.saturating_sub(1).leading_zeros()).max(2);
        let half_bits = bits.div_ceil(2);
        let keys = [rng.next_u64(), rng.next_u64(), rng.next_u64(), rng.next_u64()];
        Permutation { count, half_bits, keys }
    }

    fn at(&self, index: u64) -> u64 {
        let mut x = index;
        loop {
            x = self.feistel(x);
            if x < self.count {
                return x;
            }
        }
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for key in self.keys {
            let mixed = SplitMix64::new(right ^ key).next_u64() & mask;
            (left, right) = (right, left ^ mixed);
        }
        (left << self.half_bits) | right
    }
}

impl OffsetStream {
    fn new(data: &Dataset, config: &LoaderConfig) -> Result<OffsetStream> {
        let order = config.batching.order.clone();
        let items = match data {
            Dataset::Tokens(t) => Items::Windows { tokens: t.len() },
            Dataset::Examples(e) if config.batching.pack => match config.batching.pack_strategy {
                PackStrategy::InOrder => Items::Packed { lengths: lengths(e).into() },
                PackStrategy::BestFit => Items::Rows { rows: best_fit_rows(&lengths(e), config.batching.ctx).into() },
            },
            Dataset::Examples(e) => Items::Examples { count: e.len() },
            Dataset::Labeled(_)
            | Dataset::SourceTarget(_)
            | Dataset::Masked(_)
            | Dataset::Preference(_)
            | Dataset::Prompts(_) => Items::Examples { count: data.row_set().map_or(0, |r| r.len()) },
        };
        if let Order::Offsets(o) = &order {
            if o.ctx != config.batching.ctx || o.batch != config.batching.batch_size {
                return Err(Error::Data(format!(
                    "batch offsets are for ctx {} and batch {}, but the run uses ctx {} and batch {}",
                    o.ctx, o.batch, config.batching.ctx, config.batching.batch_size
                )));
            }
            let (limit, held) = match &items {
                Items::Windows { tokens } => {
                    (tokens - config.batching.ctx - 1, format!("{tokens} tokens, ctx {}", config.batching.ctx))
                }
                Items::Examples { count } => (count - 1, format!("{count} examples")),
                Items::Packed { .. } | Items::Rows { .. } => {
                    return Err(Error::Data("batch offsets replay windows or single examples, not packed rows".into()))
                }
            };
            if let Some(bad) = o.offsets.iter().flatten().find(|&&x| x > limit) {
                return Err(Error::Data(format!("batch offset {bad} runs past the end of {} ({held})", data.source())));
            }
        }
        Ok(OffsetStream {
            order,
            ctx: config.batching.ctx,
            batch: config.batching.batch_size,
            items,
            rng: SplitMix64::new(config.batching.seed),
            epoch: Epoch { shift: 0, order: Permutation { count: 0, half_bits: 1, keys: [0; 4] } },
            cursor: 0,
            waiting: None,
            step: 0,
        })
    }

    /// The rows of the next global batch, each the window offset or examples it holds.
    fn next_step(&mut self) -> Option<Vec<Vec<usize>>> {
        let step = self.step;
        self.step += 1;
        match &self.order {
            Order::Offsets(o) => o.offsets.get(step).map(|row| row.iter().map(|&x| vec![x]).collect()),
            Order::Shuffled => Some((0..self.batch).map(|_| self.next_row()).collect()),
        }
    }

    fn next_row(&mut self) -> Vec<usize> {
        if let Items::Rows { rows } = &self.items {
            let rows = rows.clone();
            return rows[self.next_window()].clone();
        }
        let Items::Packed { lengths } = &self.items else { return vec![self.next_window()] };
        let (lengths, ctx) = (lengths.clone(), self.ctx);
        let mut stream = std::iter::from_fn(|| Some(self.next_window())).peekable();
        let row = pack_one(&mut stream, &lengths, ctx);
        // The example that did not fit starts the next row.
        let waiting = stream.peek().copied();
        drop(stream);
        self.waiting = waiting;
        row
    }

    fn next_window(&mut self) -> usize {
        if let Some(waiting) = self.waiting.take() {
            return waiting;
        }
        if self.cursor as u64 == self.epoch.order.count {
            let (shift, count) = match self.items {
                Items::Windows { tokens } => {
                    let shift = self.rng.below(self.ctx as u64) as usize;
                    let count = (tokens - 1 - shift) / self.ctx;
                    // A shift that leaves no whole window falls back to the aligned start.
                    if count == 0 {
                        (0, (tokens - 1) / self.ctx)
                    } else {
                        (shift, count)
                    }
                }
                Items::Examples { count } => (0, count),
                Items::Packed { ref lengths } => (0, lengths.len()),
                Items::Rows { ref rows } => (0, rows.len()),
            };
            self.epoch = Epoch { shift, order: Permutation::new(count as u64, &mut self.rng) };
            self.cursor = 0;
        }
        self.cursor += 1;
        let k = self.epoch.order.at(self.cursor as u64 - 1) as usize;
        match self.items {
            Items::Windows { .. } => self.epoch.shift + self.ctx * k,
            Items::Examples { .. } | Items::Packed { .. } | Items::Rows { .. } => k,
        }
    }
}

fn build_step(data: &Dataset, config: &LoaderConfig, rows: usize, index: usize, global: &[Vec<usize>]) -> Result<Step> {
    let per_rank = rows * config.batching.accumulation;
    let mine = &global[config.rank * per_rank..(config.rank + 1) * per_rank];
    let ctx = config.batching.ctx;
    let micro_batches = mine
        .chunks(rows)
        .enumerate()
        .map(|(micro, chunk)| {
            let mut batch = micro_batch(data, config, chunk)?;
            batch.first_row = config.rank * per_rank + micro * rows;
            match &config.context {
                Some(piece) => batch.piece(piece),
                None => Ok(batch),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let global_supervised = match data {
        Dataset::Tokens(_) => (global.len() * ctx) as u64,
        Dataset::Examples(e) => global.iter().flatten().map(|&i| learned_targets(e, i)).sum(),
        Dataset::Labeled(_)
        | Dataset::SourceTarget(_)
        | Dataset::Masked(_)
        | Dataset::Preference(_)
        | Dataset::Prompts(_) => {
            let set = data.row_set();
            global.iter().flatten().map(|&i| set.map_or(0, |s| s.supervised(i))).sum()
        }
    };
    // Context ranks share rows: each averages its piece's loss as a data rank its rows'.
    let data_ranks = config.world * config.context.map_or(1, |c| c.count);
    Ok(Step { index, micro_batches, global_supervised, data_ranks })
}

/// The micro-batch of the global batch's `rows` (window offsets or example numbers, one
/// list a row) on `config`'s device.
fn micro_batch(data: &Dataset, config: &LoaderConfig, rows: &[Vec<usize>]) -> Result<Batch> {
    if let Some(set) = data.row_set() {
        return record_batch(set, rows, config.device);
    }
    let ctx = config.batching.ctx;
    let (mut inputs, mut targets) = (Vec::with_capacity(rows.len() * ctx), Vec::with_capacity(rows.len() * ctx));
    let mut layout =
        config.batching.pack.then(|| (Vec::with_capacity(rows.len() * ctx), Vec::with_capacity(rows.len() * ctx)));
    // Each row's positions before its padding.
    let mut filled = Vec::with_capacity(rows.len());
    for row in rows {
        match data {
            Dataset::Tokens(t) => {
                t.extend_window(&mut inputs, row[0], ctx);
                t.extend_window(&mut targets, row[0] + 1, ctx);
                filled.push(ctx);
            }
            Dataset::Examples(e) => {
                filled.push(examples_row(e, row, ctx, (&mut inputs, &mut targets), layout.as_mut()))
            }
            Dataset::Labeled(_)
            | Dataset::SourceTarget(_)
            | Dataset::Masked(_)
            | Dataset::Preference(_)
            | Dataset::Prompts(_) => {
                unreachable!("records are batched whole above")
            }
        }
    }
    let mut batch = batch_of(inputs, targets, rows.len(), ctx, config.device)?;
    if filled.iter().any(|&f| f < ctx) {
        let pads: Vec<bool> = filled.iter().flat_map(|&f| (0..ctx).map(move |j| j >= f)).collect();
        let shape = [rows.len() as i64, ctx as i64];
        batch.padding = Some(Tensor::f_from_slice(&pads)?.f_view(shape)?.f_to_device(config.device)?);
    }
    if let Some((positions, examples)) = layout {
        let tensor = |ids: &[i64]| -> Result<Tensor> {
            Ok(Tensor::f_from_slice(ids)?.f_view([rows.len() as i64, ctx as i64])?.f_to_device(config.device)?)
        };
        batch.layout = Some(RowLayout {
            positions: tensor(&positions)?,
            examples: tensor(&examples)?,
            segments: None,
            source_len: None,
        });
    }
    Ok(batch)
}

/// The records of `rows` (one index each) as a micro-batch on `device`.
fn record_batch(set: &dyn super::RowSet, rows: &[Vec<usize>], device: Device) -> Result<Batch> {
    let indices: Vec<usize> = rows.iter().map(|r| r[0]).collect();
    set.batch(&indices)?.to_device(device)
}

/// A micro-batch of `rows` rows of `ctx` from host ids, on `device`.
pub(super) fn batch_of(inputs: Vec<i64>, targets: Vec<i64>, rows: usize, ctx: usize, device: Device) -> Result<Batch> {
    let supervised = targets.iter().filter(|&&t| t != IGNORE).count() as u64;
    let shape = [rows as i64, ctx as i64];
    let tensor = |ids: &[i64]| -> Result<Tensor> { Ok(Tensor::f_from_slice(ids)?.f_view(shape)?.f_to_device(device)?) };
    Ok(Batch {
        inputs: tensor(&inputs)?,
        targets: tensor(&targets)?,
        supervised,
        layout: None,
        padding: None,
        first_row: 0,
        reference: None,
        desirable: None,
        margin: None,
        rollout: None,
    })
}

/// A row of `ctx` positions holding `examples` one after another, as `transformers` lays out
/// `input_ids` and `labels`: their tokens, then padding (id 0, which no earlier position
/// attends to under the causal mask); position `j`'s target is the next token of the same
/// example where the loss learns it, else [`IGNORE`] (an example's last token predicts
/// nothing, not the next example's first). Where `layout` is given, each position's place in
/// its example and the example's number in the row are appended to it. Returns the
/// positions the examples fill (the padding begins there).
fn examples_row(
    set: &ExampleSet,
    examples: &[usize],
    ctx: usize,
    (inputs, targets): (&mut Vec<i64>, &mut Vec<i64>),
    mut layout: Option<&mut (Vec<i64>, Vec<i64>)>,
) -> usize {
    let mut used = 0;
    for (n, &i) in examples.iter().enumerate() {
        let (ids, learned) = set.example(i);
        inputs.extend(ids.iter().map(|&t| i64::from(t)));
        targets.extend(ids.iter().zip(learned).skip(1).map(|(&t, &l)| if l { i64::from(t) } else { IGNORE }));
        targets.push(IGNORE);
        if let Some((positions, numbers)) = layout.as_mut() {
            positions.extend(0..ids.len() as i64);
            numbers.extend(std::iter::repeat_n(n as i64, ids.len()));
        }
        used += ids.len();
    }
    let pad = ctx - used;
    inputs.resize(inputs.len() + pad, 0);
    targets.resize(targets.len() + pad, IGNORE);
    if let Some((positions, numbers)) = layout {
        positions.extend(0..pad as i64);
        numbers.extend(std::iter::repeat_n(examples.len() as i64, pad));
    }
    used
}

/// The targets example `i` gives the loss.
fn learned_targets(examples: &ExampleSet, i: usize) -> u64 {
    examples.example(i).1.iter().skip(1).filter(|&&l| l).count() as u64
}

/// Every example's length.
fn lengths(set: &ExampleSet) -> Vec<usize> {
    (0..set.len()).map(|i| set.example(i).0.len()).collect()
}

/// Rows of `ctx` tokens filled with the examples of `order` in turn, each row taking examples
/// while the next fits (every example fits a row alone).
fn pack(
    order: &mut std::iter::Peekable<impl Iterator<Item = usize>>,
    lengths: &[usize],
    ctx: usize,
) -> Vec<Vec<usize>> {
    let mut rows = vec![];
    while order.peek().is_some() {
        rows.push(pack_one(order, lengths, ctx));
    }
    rows
}

/// One row of [`pack`]: the examples of `order` while they fit in `ctx` tokens.
fn pack_one(order: &mut std::iter::Peekable<impl Iterator<Item = usize>>, lengths: &[usize], ctx: usize) -> Vec<usize> {
    let (mut row, mut used) = (vec![], 0);
    while let Some(&i) = order.peek() {
        if used + lengths[i] > ctx && !row.is_empty() {
            break;
        }
        used += lengths[i];
        row.push(i);
        order.next();
        if used >= ctx {
            break;
        }
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TokenData;

    fn data(n: u32) -> Arc<Dataset> {
        Arc::new(TokenData::new((0..n).collect(), "test").into())
    }

    fn rows(b: &Batch) -> Vec<Vec<i64>> {
        Vec::<Vec<i64>>::try_from(&b.inputs).unwrap()
    }

    proptest::proptest! {
        /// Every index of `0..count` comes out exactly once, and the order depends on the
        /// seed.
        #[test]
        fn epoch_orders_are_permutations(count in 1u64..3000, seed in proptest::prelude::any::<u64>()) {
            let order = Permutation::new(count, &mut SplitMix64::new(seed));
            let mut seen: Vec<u64> = (0..count).map(|k| order.at(k)).collect();
            let identity = seen.iter().enumerate().all(|(k, &v)| k as u64 == v);
            seen.sort_unstable();
            proptest::prop_assert_eq!(seen, (0..count).collect::<Vec<_>>());
            if count >= 64 {
                proptest::prop_assert!(!identity, "a shuffle of {} windows left them in order", count);
            }
        }
    }

    #[test]
    fn shuffled_epochs_cover_every_window_once_and_depend_on_the_seed() {
        let cfg = LoaderConfig::new(Batching { seed: 7, ..Batching::new(4, 5) });
        // 41 tokens, ctx 4: epoch 0 of shift s has (40 - s) / 4 windows.
        let steps: Vec<Step> = DataLoader::new(data(41), cfg.clone()).unwrap().take(2).map(|s| s.unwrap()).collect();
        let starts: Vec<i64> = steps.iter().flat_map(|s| rows(&s.micro_batches[0])).map(|r| r[0]).collect();
        let first_epoch: std::collections::HashSet<i64> = starts.iter().take(9).copied().collect();
        assert!(first_epoch.len() >= 9, "no window repeats within an epoch: {starts:?}");
        let t = &steps[0].micro_batches[0];
        let (i, g) = (rows(t), Vec::<Vec<i64>>::try_from(&t.targets).unwrap());
        assert_eq!(g[0][0], i[0][1], "targets are inputs shifted by one");
        let other =
            DataLoader::new(data(41), LoaderConfig { batching: Batching { seed: 8, ..cfg.batching.clone() }, ..cfg })
                .unwrap()
                .next()
                .unwrap()
                .unwrap();
        assert_ne!(rows(&other.micro_batches[0]), rows(t));
    }

    #[test]
    fn global_batch_splits_across_ranks_and_micro_batches() {
        let offsets = BatchOffsets { ctx: 2, batch: 8, offsets: vec![(0..8).map(|i| i * 3).collect()] };
        let mut seen = vec![];
        for rank in 0..2 {
            let cfg = LoaderConfig {
                rank,
                world: 2,
                ..LoaderConfig::new(Batching { accumulation: 2, ..Batching::new(2, 8) })
            };
            let step = DataLoader::new(
                data(100),
                LoaderConfig {
                    batching: Batching { order: Order::Offsets(offsets.clone()), ..cfg.batching.clone() },
                    ..cfg
                },
            )
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
            assert_eq!(step.micro_batches.len(), 2);
            for b in &step.micro_batches {
                assert_eq!(b.inputs.size(), vec![2, 2]);
                seen.extend(rows(b).into_iter().map(|r| r[0]));
            }
        }
        assert_eq!(seen, (0..8).map(|i| i * 3).collect::<Vec<i64>>());
    }

    #[test]
    fn a_loader_started_at_step_k_continues_the_same_sequence() {
        let cfg = LoaderConfig::new(Batching { seed: 5, ..Batching::new(4, 3) });
        let all: Vec<Step> = DataLoader::new(data(200), cfg.clone()).unwrap().take(6).map(|s| s.unwrap()).collect();
        let resumed: Vec<Step> = DataLoader::new(data(200), LoaderConfig { start_step: 4, ..cfg })
            .unwrap()
            .take(2)
            .map(|s| s.unwrap())
            .collect();
        for (a, b) in all[4..].iter().zip(&resumed) {
            assert_eq!(a.index, b.index);
            assert_eq!(rows(&a.micro_batches[0]), rows(&b.micro_batches[0]));
        }
    }

    #[test]
    fn offsets_replay_ends_and_out_of_range_offsets_are_refused() {
        let offsets = BatchOffsets { ctx: 4, batch: 1, offsets: vec![vec![0], vec![5]] };
        let steps: Vec<_> = DataLoader::new(
            data(20),
            LoaderConfig::new(Batching { order: Order::Offsets(offsets), ..Batching::new(4, 1) }),
        )
        .unwrap()
        .collect();
        assert_eq!(steps.len(), 2);
        let bad = BatchOffsets { ctx: 4, batch: 1, offsets: vec![vec![16]] };
        let err = DataLoader::new(
            data(20),
            LoaderConfig::new(Batching { order: Order::Offsets(bad), ..Batching::new(4, 1) }),
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("runs past the end"), "{err}");
    }

    /// Examples of lengths 3, 5, 7, ... in a JSON Lines file, every token learned.
    fn examples(count: usize) -> Arc<Dataset> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.jsonl");
        let lines: Vec<String> =
            (0..count).map(|i| format!("{{\"text\": \"{}\"}}", "x".repeat(3 + 2 * (i % 4)))).collect();
        std::fs::write(&path, lines.join("\n")).unwrap();
        let format = super::super::ExampleFormat {
            tokenizer: &super::super::Tokenizer::Bytes,
            template: None,
            end_of_text: None,
        };
        let options = super::super::ExampleOptions { max_length: 16, drop_long: false, train_on_prompt: false };
        Arc::new(ExampleSet::prepare(&path, &format, &options).unwrap().into())
    }

    #[test]
    fn packed_rows_hold_whole_examples_that_restart_positions_and_targets() {
        let cfg = LoaderConfig::new(Batching { pack: true, seed: 3, ..Batching::new(16, 4) });
        // 20 examples of 3, 5, 7 and 9 tokens: 120 tokens, an epoch in about 2 steps.
        let steps: Vec<Step> = DataLoader::new(examples(20), cfg).unwrap().take(6).map(|s| s.unwrap()).collect();
        let mut seen = 0;
        for step in &steps {
            let b = &step.micro_batches[0];
            let layout = b.layout.as_ref().expect("packed rows carry their layout");
            let rows = |t: &Tensor| Vec::<Vec<i64>>::try_from(t).unwrap();
            let (inputs, targets, positions, numbers) =
                (rows(&b.inputs), rows(&b.targets), rows(&layout.positions), rows(&layout.examples));
            for r in 0..4 {
                for j in 0..16 {
                    let same_next =
                        j + 1 < 16 && numbers[r][j + 1] == numbers[r][j] && positions[r][j + 1] == positions[r][j] + 1;
                    if positions[r][j] == 0 && inputs[r][j] == i64::from(b'x') {
                        seen += 1;
                    }
                    // Every token learned: a target is the next token of the same example, and
                    // an example's last position (or padding) predicts nothing.
                    let want = if same_next && inputs[r][j] != 0 { inputs[r][j + 1] } else { IGNORE };
                    assert_eq!(targets[r][j], want, "row {r} position {j}");
                    if j > 0 && numbers[r][j] != numbers[r][j - 1] {
                        assert_eq!((positions[r][j], numbers[r][j]), (0, numbers[r][j - 1] + 1));
                    }
                }
            }
            assert_eq!(step.global_supervised, b.supervised);
        }
        // About two examples a row: 6 steps of 4 rows hold far more examples than rows.
        assert!(seen > 40, "{seen} examples in 24 rows");
    }

    #[test]
    fn packed_epochs_take_every_example_once() {
        let cfg = LoaderConfig::new(Batching { pack: true, seed: 5, ..Batching::new(16, 1) });
        let data = examples(20);
        let Dataset::Examples(set) = data.as_ref() else { unreachable!() };
        let mut stream = OffsetStream::new(&data, &cfg).unwrap();
        let mut taken = vec![];
        while taken.len() < 20 {
            let row = stream.next_step().unwrap().remove(0);
            assert!(row.iter().map(|&i| set.example(i).0.len()).sum::<usize>() <= 16);
            taken.extend(row);
        }
        taken.truncate(20);
        taken.sort_unstable();
        assert_eq!(taken, (0..20).collect::<Vec<_>>());
    }

    /// Best-fit rows are made once: an epoch takes each of them once, in an order the seed
    /// shuffles, and they are fewer than in-order rows of the same examples.
    #[test]
    fn best_fit_epochs_take_each_row_made_once() {
        let data = examples(20);
        let Dataset::Examples(set) = data.as_ref() else { unreachable!() };
        let made = best_fit_rows(&lengths(set), 16);
        let in_order = pack(&mut (0..20).peekable(), &lengths(set), 16);
        assert!(made.len() < in_order.len(), "{} best-fit rows against {} in order", made.len(), in_order.len());
        let epoch = |seed| {
            let batching = Batching { pack: true, pack_strategy: PackStrategy::BestFit, seed, ..Batching::new(16, 1) };
            let mut stream = OffsetStream::new(&data, &LoaderConfig::new(batching)).unwrap();
            (0..made.len()).map(|_| stream.next_step().unwrap().remove(0)).collect::<Vec<_>>()
        };
        let (a, b) = (epoch(5), epoch(6));
        let sorted = |mut rows: Vec<Vec<usize>>| {
            rows.sort();
            rows
        };
        assert_eq!(sorted(a.clone()), sorted(made.clone()));
        assert_eq!(sorted(b.clone()), sorted(made));
        assert_ne!(a, b, "the seed shuffles the rows");
    }

    #[test]
    fn indivisible_batches_and_short_data_are_errors() {
        let cfg = LoaderConfig { world: 3, ..LoaderConfig::new(Batching::new(4, 8)) };
        assert!(DataLoader::new(data(100), cfg).is_err());
        let err = DataLoader::new(data(4), LoaderConfig::new(Batching::new(4, 1))).err().unwrap();
        assert!(err.to_string().contains("fewer than"), "{err}");
    }

    /// Rows of examples mark the padding after their examples; token windows have none.
    #[test]
    fn rows_of_examples_mark_their_padding() {
        use crate::data::{ExampleFormat, ExampleOptions, ExampleSet, Tokenizer};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"text\": \"abcdef\"}\n{\"text\": \"xyz\"}").unwrap();
        let format = ExampleFormat { tokenizer: &Tokenizer::Bytes, template: None, end_of_text: None };
        let options = ExampleOptions { max_length: 8, drop_long: false, train_on_prompt: false };
        let set = ExampleSet::prepare(&path, &format, &options).unwrap();
        let cfg = LoaderConfig::new(Batching::new(8, 2));
        let step = DataLoader::new(Arc::new(set.into()), cfg).unwrap().next().unwrap().unwrap();
        let batch = &step.micro_batches[0];
        let padding = Vec::<Vec<bool>>::try_from(batch.padding.as_ref().expect("rows of examples are padded")).unwrap();
        let mut filled: Vec<usize> = padding.iter().map(|row| row.iter().take_while(|&&p| !p).count()).collect();
        filled.sort_unstable();
        assert_eq!(filled, [3, 6]);
        assert!(padding.iter().all(|row| row.iter().skip_while(|&&p| !p).all(|&p| p)));
        let windows =
            DataLoader::new(data(41), LoaderConfig::new(Batching::new(4, 2))).unwrap().next().unwrap().unwrap();
        assert!(windows.micro_batches[0].padding.is_none());
    }
}
