//! Context parallelism's attention over a process group ([`ContextGroup`]): each rank holds a
//! piece of every row's positions ([`SequencePiece`]) and attends over the whole rows.
//!
//! - *ring*: keys and values pass from rank to rank around the group while each rank merges
//!   its queries' attention over each block through the running maximum and sum of the
//!   softmax (the log-sum-exp); the backward recomputes each block's probabilities from the
//!   saved log-sum-exp and sends the keys' and values' gradients around with them, so a rank
//!   holds one block's scores at a time, forward and backward. Each block runs one of
//!   libtorch's fused attention kernels (flash attention on the CPU,
//!   memory-efficient attention on a GPU), which returns its log-sum-exp and, given the
//!   whole rows' output and log-sum-exp, its share of the gradients, so no block's scores
//!   exist at all; soft-capped scores, values narrower than keys and what the GPU's kernel
//!   does not serve (fp64, head widths not a multiple of 8) take the composite, in fp32.
//!   Keys and values travel, and fused blocks run, in the inputs' own dtype (bf16 and fp16
//!   on the GPU's tensor cores); blocks merge, and gradients gather and travel, in fp32
//!   (fp64 where the inputs are).
//! - *all-to-all* (DeepSpeed-Ulysses): an all-to-all turns each rank's positions of every
//!   head into every position of its share of the heads; attention then runs over whole rows
//!   as without the split, and a second all-to-all turns the result back.
//!
//! Owns: the exchanges and the ring's blockwise attention. Must not know which model calls
//! it, nor split rows (the data loader does, by the same [`SequencePiece`]).
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::error::text;
use crate::model::context::unseen;
use crate::model::layers::{attention, examples_differ, repeat_heads, soft_cap, AttentionOptions, ScoreTerms};
use crate::model::{ContextParallel, SequencePiece};
use crate::strategy::ContextKind;
use crate::{Error, Result};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

type Text<T> = std::result::Result<T, String>;

/// One rank's context group: its process group, its piece of every row, and how attention
/// reaches the other pieces.
pub struct ContextGroup {
    group: Arc<dyn ProcessGroup>,
    piece: SequencePiece,
    kind: ContextKind,
    /// What the last rows' layout gave, reused by every layer over those rows.
    gathered: std::sync::Mutex<Option<Gathered>>,
}

/// Each rank's places of its positions in their rows and its examples `[B, Tl]`, in rank
/// order: what a query needs to know of the keys it meets.
type RankKeys = Vec<(Tensor, Tensor)>;

/// What a group derives from one micro-batch's layout and every attention over its rows
/// (each layer's, and their recomputation) reuses: every rank's places and examples, and
/// the runs they make, which would otherwise cost a gather and a read to the host each.
struct Gathered {
    /// This rank's examples the rest was derived from, held so that no later rows'
    /// examples can take their storage's place and pass for them.
    examples: Tensor,
    len: i64,
    keys: RankKeys,
    /// The runs, once a ring's attention needs them.
    runs: Option<Vec<AlikeRows>>,
}

impl std::fmt::Debug for ContextGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "context group rank {} of {} ({:?})", self.group.rank(), self.group.size(), self.kind)
    }
}

impl ContextGroup {
    /// This rank's context group `group`, exchanging by `kind`; its piece of every row is
    /// the one `kind` lays out for its place in the group.
    pub fn new(group: Arc<dyn ProcessGroup>, kind: ContextKind) -> ContextGroup {
        let piece = piece_of(kind, group.rank(), group.size());
        ContextGroup { group, piece, kind, gathered: std::sync::Mutex::new(None) }
    }
}

/// This rank's piece of every row under `strategy`'s context parallelism on `mesh` (`None`
/// without it: rows whole).
pub fn rows_piece(mesh: &super::Mesh, strategy: &crate::strategy::Strategy) -> Option<SequencePiece> {
    use crate::strategy::Dim;
    strategy.context_parallel().map(|c| piece_of(c.kind, mesh.coordinate(Dim::Context), mesh.size(Dim::Context)))
}

/// Rank `index`'s piece of every row in a context group of `count` ranks exchanging by
/// `kind`: the ring balances causal attention's work with two runs per rank.
pub fn piece_of(kind: ContextKind, index: usize, count: usize) -> SequencePiece {
    SequencePiece { index, count, balanced: kind == ContextKind::Ring }
}

/// The group's collectives, as the autograd functions below call them: errors are strings.
#[derive(Clone)]
struct Exchange(Arc<dyn ProcessGroup>);

impl Exchange {
    fn size(&self) -> usize {
        self.0.size()
    }

    fn rank(&self) -> usize {
        self.0.rank()
    }

    /// Sends `inputs[r]` to rank `r`; returns what each rank sent this one, each shaped as
    /// `shapes[r]`.
    fn all_to_all(&self, inputs: &[Tensor], shapes: &[Vec<i64>]) -> Text<Vec<Tensor>> {
        let (work, outputs) = self.start_all_to_all(inputs, shapes)?;
        work.wait().map_err(|e| format!("context all-to-all: {e}"))?;
        Ok(outputs)
    }

    /// Starts [`Exchange::all_to_all`]: its work and the buffers it fills.
    fn start_all_to_all(&self, inputs: &[Tensor], shapes: &[Vec<i64>]) -> Text<(crate::comm::Work, Vec<Tensor>)> {
        let first = &inputs[0];
        let outputs = shapes
            .iter()
            .map(|s| Tensor::f_empty(s.as_slice(), (first.kind(), first.device())))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(text)?;
        let inputs =
            inputs.iter().map(Tensor::f_contiguous).collect::<std::result::Result<Vec<_>, _>>().map_err(text)?;
        let work = self.0.all_to_all(&outputs, &inputs).map_err(|e| format!("context all-to-all: {e}"))?;
        Ok((work, outputs))
    }

    /// Every rank's `x`, in rank order.
    fn all_gather(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let x = x.f_contiguous()?;
        let outputs = (0..self.size()).map(|_| x.f_empty_like()).collect::<std::result::Result<Vec<_>, _>>()?;
        self.0.all_gather(&outputs, &x)?.wait()?;
        Ok(outputs)
    }

    /// Starts sending `tensors` to the next rank of the ring and receiving those of the rank
    /// before, of the same shapes (one message: the tensors flattened into one buffer of
    /// the first's dtype); [`Passing::arrived`] waits for them.
    fn pass_on(&self, tensors: &[&Tensor]) -> Text<Passing> {
        let (n, me) = (self.size(), self.rank());
        let (next, previous) = ((me + 1) % n, (me + n - 1) % n);
        let flat = tensors
            .iter()
            .map(|t| t.f_to_kind(tensors[0].kind()).and_then(|t| t.f_reshape([-1])))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(text)?;
        let message = Tensor::f_cat(&flat, 0).map_err(text)?;
        let none = message.f_narrow(0, 0, 0).map_err(text)?;
        let inputs: Vec<Tensor> =
            (0..n).map(|r| if r == next { message.shallow_clone() } else { none.shallow_clone() }).collect();
        let lengths: Vec<Vec<i64>> =
            (0..n).map(|r| vec![if r == previous { message.numel() as i64 } else { 0 }]).collect();
        let (work, mut outputs) = self.start_all_to_all(&inputs, &lengths)?;
        let shapes = tensors.iter().map(|t| (t.size(), t.kind())).collect();
        Ok(Passing { work, message, received: outputs.swap_remove(previous), shapes })
    }
}

/// A ring pass under way: the message sent (kept alive until it is delivered) and the
/// buffer receiving the previous rank's.
struct Passing {
    work: crate::comm::Work,
    message: Tensor,
    received: Tensor,
    shapes: Vec<(Vec<i64>, Kind)>,
}

impl Passing {
    /// Waits for the pass; the previous rank's tensors, in the order sent.
    fn arrived(self) -> Text<Vec<Tensor>> {
        self.work.wait().map_err(|e| format!("ring pass: {e}"))?;
        drop(self.message);
        let mut at = 0;
        self.shapes
            .iter()
            .map(|(shape, kind)| {
                let len: i64 = shape.iter().product();
                let piece = self.received.f_narrow(0, at, len)?.f_view(shape.as_slice())?;
                at += len;
                piece.f_to_kind(*kind)
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(text)
    }
}

/// The all-to-all between a rank's positions of every head `[B, H, Tl, D]` and every
/// position of its share of the heads `[B, H/n, n·Tl, D]` (positions in rank order); each
/// direction's backward is the other.
struct HeadSwap {
    exchange: Exchange,
    to_heads: bool,
}

impl HeadSwap {
    fn swap(&self, x: &Tensor, to_heads: bool) -> Text<Tensor> {
        let n = self.exchange.size() as i64;
        // Pieces leave along one dimension and the received ones join along the other.
        let (split, join) = if to_heads { (1, 2) } else { (2, 1) };
        let inputs = x.f_chunk(n, split).map_err(text)?;
        let shapes = vec![inputs[0].size(); n as usize];
        let received = self.exchange.all_to_all(&inputs, &shapes)?;
        Tensor::f_cat(&received, join).map_err(text)
    }
}

impl strata_ext::Function for HeadSwap {
    fn forward(&mut self, inputs: &[Tensor]) -> Text<Vec<Tensor>> {
        Ok(vec![self.swap(&inputs[0], self.to_heads)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> Text<Vec<Tensor>> {
        match grads[0].defined() {
            true => Ok(vec![self.swap(&grads[0], !self.to_heads)?]),
            false => Ok(vec![Tensor::new()]),
        }
    }
}

/// What a block of the ring's attention needs beside the queries and keys: the places and
/// examples of the queries and of each rank's keys, the scale and the options.
struct Blocks {
    exchange: Exchange,
    /// Query heads per key/value head: the ring passes keys and values unrepeated and
    /// repeats each block where it attends.
    group: i64,
    options: AttentionOptions,
    scale: f64,
    query_places: Tensor,
    query_examples: Tensor,
    /// Per rank of the group: the places of its positions and their examples.
    keys: RankKeys,
    /// The runs of one example that each rank's positions make, by rows laid out alike,
    /// whose places say what is seen, so the fused kernel needs a mask only where a window
    /// cuts across a band of queries; `None` where they do not decide it.
    runs: Option<Vec<AlikeRows>>,
}

/// Batch rows (start, count) whose positions every rank holds in the same runs of one
/// example, and those runs, rank by rank.
#[derive(Clone)]
struct AlikeRows {
    rows: (i64, i64),
    runs: Vec<Vec<Run>>,
}

/// Positions of a rank of one example, adjacent in its row: where they start among the
/// rank's and in the row, their length, and the example.
#[derive(Clone, Copy, PartialEq)]
struct Run {
    start: i64,
    at: i64,
    len: i64,
    example: i64,
}

/// Queries a band takes at most where a sliding window hides some of a run's keys from
/// some of its queries: each band is a causal tile over its own positions, a whole one over
/// the keys all its queries see, and a masked one (at most this square) over those some see.
const BAND_QUERIES: i64 = 512;

/// Positions (start, length) among a rank's.
type Span = (i64, i64);

/// Batch rows (start, count) and query positions of a tensor `[B, H, T, ..]`.
type Region = ((i64, i64), Span);

/// `t`'s part in `region`.
fn part(t: &Tensor, ((row, rows), (start, len)): Region) -> Result<Tensor> {
    Ok(t.f_narrow(0, row, rows)?.f_narrow(2, start, len)?)
}

/// A pair of query and key positions the fused kernel computes in one call: the batch rows,
/// the queries' range (start, length) among this rank's, the keys' among the owner's, and
/// what the queries see of those keys.
struct Tile {
    rows: (i64, i64),
    queries: (i64, i64),
    keys: (i64, i64),
    seen: Seen,
}

impl Tile {
    /// The tile's queries (and what is shaped as them) in `t`.
    fn queries_of(&self, t: &Tensor) -> Result<Tensor> {
        part(t, (self.rows, self.queries))
    }

    /// The tile's keys (and what is shaped as them) in `t`.
    fn keys_of(&self, t: &Tensor) -> Result<Tensor> {
        part(t, (self.rows, self.keys))
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Seen {
    /// Every key.
    All,
    /// Each query, the keys up to its own place (the same places).
    Causal,
    /// As the places and examples say: the tile takes a mask, built when it runs.
    Masked,
}

/// What the fused kernel takes for one tile beside its queries and keys: the additive mask
/// and the queries that see none of its keys (masked tiles), and the causal flag.
struct TileTerms {
    mask: Option<Tensor>,
    blind: Option<Tensor>,
    causal: bool,
}

/// The tiles of the queries of run `query` over the keys of run `key` of the same example
/// (`key` no later in the row), as (queries, keys, seen) ranges among the ranks' positions:
/// one tile where the window (if any) hides none of the keys from any query or all of them
/// from every query (then none), else bands of [`BAND_QUERIES`] queries.
fn run_tiles(query: Run, key: Run, window: Option<i64>) -> Vec<(Span, Span, Seen)> {
    let own = key.at == query.at;
    let whole = if own { Seen::Causal } else { Seen::All };
    let (q_end, k_end) = (query.at + query.len, key.at + key.len);
    let Some(w) = window.filter(|&w| q_end - 1 - key.at >= w) else {
        return vec![((query.start, query.len), (key.start, key.len), whole)];
    };
    if query.at - (k_end - 1) >= w {
        return vec![];
    }
    // Row positions [from, to) to the ranks' ranges.
    let queries = |from: i64, to: i64| (query.start + from - query.at, to - from);
    let keys = |from: i64, to: i64| (key.start + from - key.at, to - from);
    let band = w.min(BAND_QUERIES);
    let mut tiles = vec![];
    for s in (query.at..q_end).step_by(band as usize) {
        let e = (s + band).min(q_end);
        if own {
            tiles.push((queries(s, e), keys(s, e), Seen::Causal));
        }
        // Every query of the band sees the keys from e − w up to its own; some see those
        // from s − w + 1 on.
        let (seen_by_all, seen_by_some) = (e - w, s - w + 1);
        let (all_from, all_to) = (seen_by_all.max(key.at), s.min(k_end));
        if all_from < all_to {
            tiles.push((queries(s, e), keys(all_from, all_to), Seen::All));
        }
        let (some_from, some_to) = (seen_by_some.max(key.at), seen_by_all.min(k_end));
        if some_from < some_to {
            tiles.push((queries(s, e), keys(some_from, some_to), Seen::Masked));
        }
    }
    tiles
}

/// The fused kernel a block's tiles run on: libtorch's attention kernels that return each
/// query's log-sum-exp and whose backward, given the whole rows' output and log-sum-exp,
/// takes a tile's probabilities as its share of the whole softmax.
#[derive(Clone, Copy)]
enum Kernel {
    /// Flash attention for the CPU.
    Cpu,
    /// Memory-efficient attention on a GPU: fp32, fp16 or bf16, head widths a multiple
    /// of 8, the mask as an additive bias over every head.
    Gpu,
}

impl Kernel {
    /// The kernel that serves the queries `q` and values `v` of scores without a cap
    /// (neither kernel has one), where one does: values as wide as the keys (both want
    /// one head width).
    fn serving(q: &Tensor, v: &Tensor, options: &AttentionOptions) -> Option<Kernel> {
        let width = q.size()[3];
        if options.softcap.is_some() || v.size()[3] != width {
            return None;
        }
        match q.device() {
            Device::Cpu => Some(Kernel::Cpu),
            Device::Cuda(_) if q.kind() != Kind::Double && width % 8 == 0 => Some(Kernel::Gpu),
            _ => None,
        }
    }

    /// The additive mask (0 seen, −∞ not; `q`'s dtype) for the keys `hidden` (`[B, 1, Tq,
    /// Tk]`, true where not seen) hides, as the kernel reads it: on a GPU over every one of
    /// `q`'s heads, in rows whose storage is padded to 16 keys (the kernel reads them
    /// aligned).
    fn mask(self, hidden: &Tensor, q: &Tensor) -> Result<Tensor> {
        let shape = hidden.size();
        match self {
            Kernel::Cpu => {
                Ok(Tensor::f_zeros(shape.as_slice(), (q.kind(), q.device()))?
                    .f_masked_fill(hidden, f64::NEG_INFINITY)?)
            }
            Kernel::Gpu => {
                let keys = shape[3];
                let padded = [&shape[..3], &[(keys + 15) / 16 * 16]].concat();
                let mut mask = Tensor::f_zeros(padded.as_slice(), (q.kind(), q.device()))?.f_narrow(3, 0, keys)?;
                _ = mask.f_masked_fill_(hidden, f64::NEG_INFINITY)?;
                Ok(mask.f_expand([shape[0], q.size()[1], shape[2], keys], false)?)
            }
        }
    }

    /// One tile's output and log-sum-exp (`[B, H, Tq]`, fp32 or the inputs' dtype).
    fn forward(
        self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (mask, causal): (Option<&Tensor>, bool),
        scale: f64,
    ) -> Result<(Tensor, Tensor)> {
        match self {
            Kernel::Cpu => {
                Ok(Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, mask, scale)?)
            }
            Kernel::Gpu => {
                let (out, lse, _, _) =
                    Tensor::f_internal_scaled_dot_product_efficient_attention(q, k, v, mask, true, 0.0, causal, scale)?;
                // Its log-sum-exp comes padded to a multiple of 32 queries.
                Ok((out, lse.f_narrow(2, 0, q.size()[2])?))
            }
        }
    }

    /// One tile's gradients of `q`, `k` and `v`, given the whole rows' output `out` and
    /// log-sum-exp `lse` for its queries and their gradient `grad`.
    fn backward(
        self,
        (grad, out, lse): (&Tensor, &Tensor, &Tensor),
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (mask, causal): (Option<&Tensor>, bool),
        scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match self {
            Kernel::Cpu => Ok(Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out, lse, 0.0, causal, mask, scale,
            )?),
            Kernel::Gpu => {
                // The kernel's own layout is [B, T, H, D]; it reads the log-sum-exp in
                // blocks of 32 queries, and draws no dropout (its seed is not read).
                let positions_first = |x: &Tensor| x.f_transpose(1, 2);
                let (queries, keys) = (q.size()[2], k.size()[2]);
                let lse = lse.f_constant_pad_nd([0, (queries + 31) / 32 * 32 - queries])?.f_contiguous()?;
                let unused_seed = Tensor::f_zeros([], (Kind::Int64, Device::Cpu))?;
                let causal_from_top_left = i64::from(causal);
                let (dq, dk, dv, _) = Tensor::f_internal_efficient_attention_backward(
                    &positions_first(grad)?,
                    &positions_first(q)?,
                    &positions_first(k)?,
                    &positions_first(v)?,
                    mask,
                    // Read (fp16 and bf16) as contiguous in that layout.
                    &positions_first(out)?.f_contiguous()?,
                    None,
                    None,
                    queries,
                    keys,
                    &lse,
                    0.0,
                    &unused_seed,
                    &unused_seed,
                    causal_from_top_left,
                    false,
                    scale,
                    None,
                    None,
                    false,
                )?;
                Ok((dq.f_transpose(1, 2)?, dk.f_transpose(1, 2)?, dv.f_transpose(1, 2)?))
            }
        }
    }
}

impl Blocks {
    /// The fused kernel's calls over rank `owner`'s keys. Where runs decide what is seen,
    /// tiles per pair of runs of one example where the queries see any key ([`run_tiles`]):
    /// whole where the keys lie earlier in the row, causal where they are the queries' own,
    /// in bands where a window hides some of them; otherwise one tile of all this rank's
    /// queries over all the owner's keys, masked.
    fn tiles(&self, q: &Tensor, owner: usize) -> Vec<Tile> {
        let Some(alike) = &self.runs else {
            let (queries, keys) = (q.size()[2], self.keys[owner].0.size()[0]);
            return vec![Tile { rows: (0, q.size()[0]), queries: (0, queries), keys: (0, keys), seen: Seen::Masked }];
        };
        let mut tiles = vec![];
        for AlikeRows { rows, runs } in alike {
            for query in &runs[self.exchange.rank()] {
                let seen =
                    |key: &&Run| key.example == query.example && (self.options.bidirectional || key.at <= query.at);
                for key in runs[owner].iter().filter(seen) {
                    let pairs = match self.options.bidirectional {
                        true => vec![((query.start, query.len), (key.start, key.len), Seen::All)],
                        false => run_tiles(*query, *key, self.options.window),
                    };
                    tiles.extend(pairs.into_iter().map(|(queries, keys, seen)| Tile {
                        rows: *rows,
                        queries,
                        keys,
                        seen,
                    }));
                }
            }
        }
        tiles
    }

    /// What `kernel` takes for `tile` of rank `owner`'s keys beside them: a masked tile's
    /// mask and the queries that see none of its keys (`[B, 1, Tq]`: the CPU's kernel gives
    /// those a log-sum-exp of 0, which the merge must read as −∞, and their output is no
    /// value).
    fn terms(&self, tile: &Tile, owner: usize, kernel: Kernel, q: &Tensor) -> Result<TileTerms> {
        if tile.seen != Seen::Masked {
            return Ok(TileTerms { mask: None, blind: None, causal: tile.seen == Seen::Causal });
        }
        let (places, examples) = &self.keys[owner];
        let ((row, rows), (queries, keys)) = (tile.rows, (tile.queries, tile.keys));
        let examples_of = |e: &Tensor, (start, len): (i64, i64)| e.f_narrow(0, row, rows)?.f_narrow(1, start, len);
        let hidden = unseen(
            &self.query_places.f_narrow(0, queries.0, queries.1)?,
            &places.f_narrow(0, keys.0, keys.1)?,
            &examples_of(&self.query_examples, queries)?,
            &examples_of(examples, keys)?,
            &self.options,
        )?;
        let blind = hidden.f_all_dim(-1, false)?;
        Ok(TileTerms { mask: Some(kernel.mask(&hidden, q)?), blind: Some(blind), causal: false })
    }

    /// Scores `[B, H, Tq, Tk]` (fp32 or fp64) of the queries over rank `owner`'s keys, soft-capped
    /// and masked, and the cap's `tanh` where there is one (its derivative's factor).
    fn scores(&self, q: &Tensor, k: &Tensor, owner: usize) -> Result<(Tensor, Option<Tensor>)> {
        let raw = q.f_matmul(&k.f_transpose(-2, -1)?)?.f_mul_scalar(self.scale)?;
        let (scores, tanh) = match self.options.softcap {
            Some(cap) => {
                let capped = soft_cap(&raw, cap)?;
                let tanh = capped.f_div_scalar(cap)?;
                (capped, Some(tanh))
            }
            None => (raw, None),
        };
        let (places, examples) = &self.keys[owner];
        let hidden = unseen(&self.query_places, places, &self.query_examples, examples, &self.options)?;
        Ok((scores.f_masked_fill(&hidden, f64::NEG_INFINITY)?, tanh))
    }
}

/// The ring's attention as one autograd function of the queries, keys, values and, where
/// given, the sink logits.
struct RingAttention {
    blocks: Blocks,
    /// The inputs (as given) and the output and log-sum-exp (fp32 or fp64), for the backward.
    saved: Option<(Vec<Tensor>, Tensor, Tensor)>,
}

/// The precision the ring merges and gathers gradients in for inputs of `kind`: fp32, or
/// fp64 where they are.
fn wide(kind: Kind) -> Kind {
    match kind {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    }
}

/// `t` in [`wide`]'s precision.
fn float(t: &Tensor) -> Result<Tensor> {
    Ok(t.f_to_kind(wide(t.kind()))?)
}

impl RingAttention {
    fn forward(&mut self, inputs: &[Tensor]) -> Result<Tensor> {
        // Keys and values travel in their own dtype: casting them first would only send
        // more bytes. The fused kernel reads them so too; the composite widens each block.
        let (q, mut k, mut v) = (inputs[0].shallow_clone(), inputs[1].shallow_clone(), inputs[2].shallow_clone());
        let (n, me) = (self.blocks.exchange.size(), self.blocks.exchange.rank());
        let rows = q.size()[..3].to_vec();
        let all_rows = ((0, rows[0]), (0, rows[2]));
        let kernel = Kernel::serving(&q, &v, &self.blocks.options);
        let merged = wide(q.kind());
        let mut running = Running::new(&rows, v.size()[3], (merged, q.device()))?;
        for step in 0..n {
            let owner = (me + n - step) % n;
            // The next block travels while this one is computed.
            let passing = (step + 1 < n).then(|| self.blocks.exchange.pass_on(&[&k, &v])).transpose();
            let passing = passing.map_err(Error::Comm)?;
            let (kr, vr) = (repeat_heads(&k, self.blocks.group)?, repeat_heads(&v, self.blocks.group)?);
            if let Some(kernel) = kernel {
                // Each tile's softmax arrives whole: its output weighs in by its log-sum-exp.
                for tile in self.blocks.tiles(&q, owner) {
                    let terms = self.blocks.terms(&tile, owner, kernel, &q)?;
                    let (out, lse) = kernel.forward(
                        (&tile.queries_of(&q)?, &tile.keys_of(&kr)?, &tile.keys_of(&vr)?),
                        (terms.mask.as_ref(), terms.causal),
                        self.blocks.scale,
                    )?;
                    let (out, lse) = (out.f_to_kind(merged)?, lse.f_to_kind(merged)?);
                    let (out, lse) = match &terms.blind {
                        Some(blind) => (
                            out.f_masked_fill(&blind.f_unsqueeze(-1)?, 0.0)?,
                            lse.f_masked_fill(blind, f64::NEG_INFINITY)?,
                        ),
                        None => (out, lse),
                    };
                    let region = (tile.rows, tile.queries);
                    running.merge(region, &lse.f_unsqueeze(-1)?, |weight| Ok(Some(out.f_mul(weight)?)))?;
                }
            } else {
                let (scores, _) = self.blocks.scores(&float(&q)?, &float(&kr)?, owner)?;
                let vr = float(&vr)?;
                running.merge(all_rows, &scores, |probs| Ok(Some(probs.f_matmul(&vr)?)))?;
            }
            if let Some(passing) = passing {
                [k, v] = arrived_pair(passing)?;
            }
        }
        if let Some(sinks) = inputs.get(3) {
            // A sink is one more key whose value is nothing.
            let sink = float(sinks)?.f_view([1, -1, 1])?.f_expand(rows.as_slice(), false)?;
            running.merge(all_rows, &sink.f_unsqueeze(-1)?, |_| Ok(None))?;
        }
        let Running { max, sum, acc } = running;
        let out = acc.f_div(&sum.f_unsqueeze(-1)?)?;
        let lse = max.f_add(&sum.f_log()?)?;
        self.saved = Some((inputs.iter().map(Tensor::shallow_clone).collect(), out.shallow_clone(), lse));
        Ok(out.f_to_kind(inputs[0].kind())?)
    }

    fn backward(&mut self, grad: &Tensor) -> Result<Vec<Tensor>> {
        let (inputs, out, lse) =
            self.saved.take().ok_or_else(|| Error::Model("ring attention: backward twice".into()))?;
        let (q, mut k, mut v) = (inputs[0].shallow_clone(), inputs[1].shallow_clone(), inputs[2].shallow_clone());
        let (n, me) = (self.blocks.exchange.size(), self.blocks.exchange.rank());
        let kernel = Kernel::serving(&q, &v, &self.blocks.options);
        let grad_wide = float(grad)?;
        // The fused kernel reads the gradient and the output in the queries' dtype.
        let (grad, out_narrow) = (grad.f_to_kind(q.kind())?, out.f_to_kind(q.kind())?);
        // d(loss)/d(score) = p · (dO·v − Σ p dO·v): the second term per query is dO·out.
        let delta = grad_wide.f_mul(&out)?.f_sum_dim_intlist(-1, false, out.kind())?.f_unsqueeze(-1)?;
        let lse_column = lse.f_unsqueeze(-1)?;
        // Gradients gather in the merge's precision, block by block, and travel so.
        let gathered_in = (wide(q.kind()), q.device());
        let mut dq = Tensor::f_zeros(q.size(), gathered_in)?;
        // Each block's key and value gradients gather here, then join those the ranks before
        // gave the same keys as they arrive, and pass on while the next block is computed
        // (after the last block, one more pass brings each home).
        let mut gathered: Option<Passing> = None;
        for step in 0..n {
            let owner = (me + n - step) % n;
            let exchange = &self.blocks.exchange;
            // The next block's keys and values travel while this one's gradients are computed.
            let passing = (step + 1 < n).then(|| exchange.pass_on(&[&k, &v])).transpose().map_err(Error::Comm)?;
            let group = self.blocks.group;
            let (kr, vr) = (repeat_heads(&k, group)?, repeat_heads(&v, group)?);
            let (mut dk, mut dv) = if let Some(kernel) = kernel {
                let (dk, dv) = (Tensor::f_zeros(k.size(), gathered_in)?, Tensor::f_zeros(v.size(), gathered_in)?);
                // Given the whole rows' output and log-sum-exp, the kernel's backward takes
                // each tile's probabilities as their share of the whole softmax.
                for tile in self.blocks.tiles(&q, owner) {
                    let queries = |t: &Tensor| tile.queries_of(t);
                    let terms = self.blocks.terms(&tile, owner, kernel, &q)?;
                    let (bq, bk, bv) = kernel.backward(
                        (&queries(&grad)?, &queries(&out_narrow)?, &queries(&lse)?),
                        (&queries(&q)?, &tile.keys_of(&kr)?, &tile.keys_of(&vr)?),
                        (terms.mask.as_ref(), terms.causal),
                        self.blocks.scale,
                    )?;
                    let summed = |b: &Tensor| summed_over_group(&b.f_to_kind(gathered_in.0)?, group);
                    _ = queries(&dq)?.f_add_(&bq)?;
                    _ = tile.keys_of(&dk)?.f_add_(&summed(&bk)?)?;
                    _ = tile.keys_of(&dv)?.f_add_(&summed(&bv)?)?;
                }
                (dk, dv)
            } else {
                let (q_wide, kr, vr) = (float(&q)?, float(&kr)?, float(&vr)?);
                let (scores, tanh) = self.blocks.scores(&q_wide, &kr, owner)?;
                let probs = scores.f_sub(&lse_column)?.f_exp()?;
                let dv = summed_over_group(&probs.f_transpose(-2, -1)?.f_matmul(&grad_wide)?, group)?;
                let mut dscores = probs.f_mul(&grad_wide.f_matmul(&vr.f_transpose(-2, -1)?)?.f_sub(&delta)?)?;
                if let Some(tanh) = tanh {
                    dscores = dscores.f_mul(&tanh.f_square()?.f_neg()?.f_add_scalar(1.0)?)?;
                }
                let dscores = dscores.f_mul_scalar(self.blocks.scale)?;
                dq = dq.f_add(&dscores.f_matmul(&kr)?)?;
                (summed_over_group(&dscores.f_transpose(-2, -1)?.f_matmul(&q_wide)?, group)?, dv)
            };
            if let Some(earlier) = gathered.take() {
                let [edk, edv] = arrived_pair(earlier)?;
                (dk, dv) = (dk.f_add(&edk)?, dv.f_add(&edv)?);
            }
            gathered = Some(exchange.pass_on(&[&dk, &dv]).map_err(Error::Comm)?);
            if let Some(passing) = passing {
                [k, v] = arrived_pair(passing)?;
            }
        }
        let gathered = gathered.ok_or_else(|| Error::Comm("ring pass: an empty ring".into()))?;
        let [dk, dv] = arrived_pair(gathered)?;
        let mut grads =
            vec![dq.f_to_kind(inputs[0].kind())?, dk.f_to_kind(inputs[1].kind())?, dv.f_to_kind(inputs[2].kind())?];
        if let Some(sinks) = inputs.get(3) {
            // A sink's share of each softmax, times that query's −dO·out.
            let sink = float(sinks)?.f_view([1, -1, 1])?;
            let share = sink.f_sub(&lse)?.f_exp()?;
            let dsink = share.f_mul(&delta.f_squeeze_dim(-1)?)?.f_neg()?.f_sum_dim_intlist(
                [0i64, 2].as_slice(),
                false,
                share.kind(),
            )?;
            grads.push(dsink.f_to_kind(sinks.kind())?);
        }
        Ok(grads)
    }
}

/// The two tensors a ring pass brings.
fn arrived_pair(passing: Passing) -> Result<[Tensor; 2]> {
    let arrived = passing.arrived().map_err(Error::Comm)?;
    <[Tensor; 2]>::try_from(arrived).map_err(|_| Error::Comm("ring pass: not two tensors".into()))
}

/// The gradient of [`repeat_heads`]' input from its output's `grad` (`[B, Hkv·times, T, D]`).
fn summed_over_group(grad: &Tensor, times: i64) -> Result<Tensor> {
    if times == 1 {
        return Ok(grad.shallow_clone());
    }
    let s = grad.size();
    let grouped = grad.f_reshape([s[0], s[1] / times, times, s[2], s[3]])?;
    Ok(grouped.f_sum_dim_intlist(2, false, grad.kind())?)
}

/// The runs of one example among a rank's positions `row[start..start + len]`, which are
/// the row's run at `place`, each starting where its example does.
fn example_runs(row: &[i64], start: i64, len: i64, place: i64) -> Vec<Run> {
    let mut runs: Vec<Run> = vec![];
    for i in start..start + len {
        let example = row[i as usize];
        match runs.last_mut() {
            Some(last) if last.example == example => last.len += 1,
            _ => runs.push(Run { start: i, at: place * len + i - start, len: 1, example }),
        }
    }
    runs
}

/// The example every position of `examples` belongs to, where they all belong to one.
fn single_example(examples: &Tensor) -> Result<Option<i64>> {
    let (low, high) = (examples.f_min()?.int64_value(&[]), examples.f_max()?.int64_value(&[]));
    Ok((low == high).then_some(low))
}

/// The running maximum, sum and weighted values of each query's softmax (`[B, H, Tq]`,
/// `[B, H, Tq]`, `[B, H, Tq, Dv]`), merged block by block.
struct Running {
    max: Tensor,
    sum: Tensor,
    acc: Tensor,
}

impl Running {
    fn new(rows: &[i64], value_width: i64, options: (Kind, tch::Device)) -> Result<Running> {
        Ok(Running {
            max: Tensor::f_full(rows, f64::NEG_INFINITY, options)?,
            sum: Tensor::f_zeros(rows, options)?,
            acc: Tensor::f_zeros([rows, &[value_width]].concat(), options)?,
        })
    }

    /// Merges the scores (`[B', H, Tq', Tk']`) of the queries in `region` over some keys: the running maximum raised to cover them, the earlier sums scaled to it,
    /// their probabilities against it added to the sum and `weighed(probabilities)`, where
    /// the keys have values, to the weighted values. A query that has seen nothing yet
    /// keeps a maximum of −∞ without producing NaN.
    fn merge(
        &mut self,
        region: Region,
        scores: &Tensor,
        weighed: impl FnOnce(&Tensor) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        let (mut max, mut sum, mut acc) =
            (part(&self.max, region)?, part(&self.sum, region)?, part(&self.acc, region)?);
        let raised = max.f_maximum(&scores.f_amax([-1], false)?)?;
        let base = raised.f_where_scalarother(&raised.f_isfinite()?, 0.0)?;
        let scale = max.f_sub(&base)?.f_exp()?;
        let probs = scores.f_sub(&base.f_unsqueeze(-1)?)?.f_exp()?;
        max.f_copy_(&raised)?;
        sum.f_copy_(&sum.f_mul(&scale)?.f_add(&probs.f_sum_dim_intlist(-1, false, probs.kind())?)?)?;
        let scaled = acc.f_mul(&scale.f_unsqueeze(-1)?)?;
        acc.f_copy_(&match weighed(&probs)? {
            Some(values) => scaled.f_add(&values)?,
            None => scaled,
        })?;
        Ok(())
    }
}

impl strata_ext::Function for RingAttention {
    fn forward(&mut self, inputs: &[Tensor]) -> Text<Vec<Tensor>> {
        Ok(vec![RingAttention::forward(self, inputs).map_err(text)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> Text<Vec<Tensor>> {
        let count = self.saved.as_ref().map_or(3, |(inputs, _, _)| inputs.len());
        match grads[0].defined() {
            true => RingAttention::backward(self, &grads[0]).map_err(text),
            false => Ok((0..count).map(|_| Tensor::new()).collect()),
        }
    }
}

impl ContextGroup {
    fn exchange(&self) -> Exchange {
        Exchange(self.group.clone())
    }

    fn swap(&self, x: &Tensor, to_heads: bool) -> Result<Tensor> {
        let f = HeadSwap { exchange: self.exchange(), to_heads };
        Ok(strata_ext::apply_function(f, &[x])?.remove(0))
    }

    /// The runs of one example that every rank's positions make in rows of `len` (read
    /// from each rank's examples, `keys`), by rows laid out alike.
    fn alike_runs(&self, len: i64, keys: &[(Tensor, Tensor)]) -> Result<Vec<AlikeRows>> {
        // Each rank's runs, then each row's runs on every rank.
        let mut per_rank = vec![];
        for (r, (_, examples)) in keys.iter().enumerate() {
            let (run, places) = self.piece.of_rank(r).runs(len)?;
            let rows = examples.size()[0];
            let examples = Vec::<i64>::try_from(examples.f_to_device(Device::Cpu)?.f_reshape([-1])?)?;
            let width = places.len() as i64 * run;
            let rows_runs: Vec<Vec<Run>> = (0..rows)
                .map(|b| {
                    let row = &examples[(b * width) as usize..((b + 1) * width) as usize];
                    places
                        .iter()
                        .enumerate()
                        .flat_map(|(i, &place)| example_runs(row, i as i64 * run, run, place))
                        .collect()
                })
                .collect();
            per_rank.push(rows_runs);
        }
        let mut alike: Vec<AlikeRows> = vec![];
        for b in 0..per_rank[0].len() {
            let runs: Vec<Vec<Run>> = per_rank.iter().map(|rank| rank[b].clone()).collect();
            match alike.last_mut() {
                Some(last) if last.runs == runs => last.rows.1 += 1,
                _ => alike.push(AlikeRows { rows: (b as i64, 1), runs }),
            }
        }
        Ok(alike)
    }

    /// Every rank's places and examples in rows of `len` whose piece here has `examples`
    /// and, with `runs`, the runs they make (`None` without): derived once per rows, every
    /// rank of the group alike, since every rank attends over the same rows in the same order.
    fn gathered(&self, len: i64, examples: &Tensor, runs: bool) -> Result<(RankKeys, Option<Vec<AlikeRows>>)> {
        let mut cache = self.gathered.lock().map_err(|_| Error::Engine("a context group's lock is poisoned".into()))?;
        let fresh = |g: &Gathered| {
            let same = g.examples.data_ptr() == examples.data_ptr() && g.examples.device() == examples.device();
            same && g.len == len && g.examples.size() == examples.size()
        };
        let g = match cache.take() {
            Some(g) if fresh(&g) => g,
            _ => Gathered { examples: examples.shallow_clone(), len, keys: self.keys(len, examples)?, runs: None },
        };
        let g = cache.insert(g);
        if runs && g.runs.is_none() {
            g.runs = Some(self.alike_runs(len, &g.keys)?);
        }
        let keys = g.keys.iter().map(|(p, e)| (p.shallow_clone(), e.shallow_clone())).collect();
        Ok((keys, g.runs.clone().filter(|_| runs)))
    }

    /// Each rank's places and examples `[B, Tl]`, in rank order.
    fn keys(&self, len: i64, examples: &Tensor) -> Result<RankKeys> {
        let all = self.exchange().all_gather(examples)?;
        all.into_iter().enumerate().map(|(r, ex)| Ok((self.piece.of_rank(r).places(len, ex.device())?, ex))).collect()
    }
}

impl ContextParallel for ContextGroup {
    fn size(&self) -> i64 {
        self.group.size() as i64
    }

    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>> {
        all_reduce_values(self.group.as_ref(), values, ReduceOp::Sum)
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        options: &AttentionOptions,
        examples: &Tensor,
        sinks: Option<&Tensor>,
    ) -> Result<Tensor> {
        let n = self.group.size() as i64;
        let len = q.size()[2] * n;
        let (heads, kv_heads) = (q.size()[1], k.size()[1]);
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::Model(format!("context attention: {kv_heads} key/value heads for {heads} query heads")));
        }
        let group = heads / kv_heads;
        // A window both ways, or chunks the row spans more than one of, need a mask;
        // otherwise the runs and the window decide what a query of the ring sees.
        let by_runs = self.kind == ContextKind::Ring
            && !(options.window.is_some() && options.bidirectional)
            && options.chunk.is_none_or(|c| c >= len);
        let (keys, runs) = self.gathered(len, examples, by_runs)?;
        match self.kind {
            ContextKind::AllToAll => {
                if heads % n != 0 {
                    return Err(Error::Config(format!(
                        "context_parallel all_to_all: {n} ranks do not divide this rank's {heads} heads"
                    )));
                }
                // Keys and values cross repeated as few times as lets every rank take an
                // equal share of their heads (the one its query heads read), then repeat
                // to those query heads.
                let crossing = (1..=group).find(|f| group % f == 0 && kv_heads * f % n == 0).unwrap_or(group);
                let exchanged = |x: &Tensor| -> Result<Tensor> {
                    repeat_heads(&self.swap(&repeat_heads(x, crossing)?, true)?, group / crossing)
                };
                let (q, k, v) = (self.swap(q, true)?, exchanged(k)?, exchanged(v)?);
                // Rank r holds the r-th run of every row, so the exchange leaves every
                // position in its row's order: attention over whole rows as one process
                // computes it (fused where the rows hold one example each), masked only
                // between packed examples.
                let examples = Tensor::f_cat(&keys.iter().map(|(_, e)| e).collect::<Vec<_>>(), 1)?;
                let hidden = match single_example(&examples)? {
                    Some(_) => None,
                    None => Some(examples_differ(&examples, &examples)?),
                };
                // This rank's heads' sinks.
                let mine = heads / n;
                let sinks = sinks.map(|s| s.f_narrow(0, self.group.rank() as i64 * mine, mine)).transpose()?;
                let terms = ScoreTerms { bias: None, sinks: sinks.as_ref() };
                let y = attention(&q, &k, &v, options, hidden.as_ref(), terms, None)?;
                self.swap(&y, false)
            }
            ContextKind::Ring => {
                let query_places = self.piece.places(len, q.device())?;
                let scale = options.scale.unwrap_or(1.0 / (q.size()[3] as f64).sqrt());
                let blocks = Blocks {
                    exchange: self.exchange(),
                    group,
                    options: *options,
                    scale,
                    query_places,
                    query_examples: examples.shallow_clone(),
                    keys,
                    runs,
                };
                let f = RingAttention { blocks, saved: None };
                let mut inputs = vec![q, k, v];
                inputs.extend(sinks);
                Ok(strata_ext::apply_function(f, &inputs)?.remove(0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// The tiles of a query run over a key run of one example cover every pair of
        /// positions the query sees exactly once: whole tiles and causal ones only where
        /// it sees them, and every masked tile a band of at most [`BAND_QUERIES`] queries.
        #[test]
        fn tiles_cover_each_seen_pair_once(
            own: bool,
            (query_len, key_len) in (1i64..700, 1i64..700),
            gap in 0i64..900,
            (query_start, key_start) in (0i64..50, 0i64..50),
            window in proptest::option::of(1i64..1400),
        ) {
            let query = Run { start: query_start, at: 2000, len: query_len, example: 3 };
            let key = match own {
                true => query,
                false => Run { start: key_start, at: query.at - gap - key_len, len: key_len, example: 3 },
            };
            let seen = |i: i64, j: i64| {
                let behind = query.at + i - (key.at + j);
                behind >= 0 && window.is_none_or(|w| behind < w)
            };
            let mut covered = vec![0u8; (query.len * key.len) as usize];
            for ((q0, ql), (k0, kl), kind) in run_tiles(query, key, window) {
                let (q0, k0) = (q0 - query.start, k0 - key.start);
                prop_assert!(q0 >= 0 && k0 >= 0 && q0 + ql <= query.len && k0 + kl <= key.len);
                prop_assert!(kind != Seen::Masked || ql <= BAND_QUERIES);
                for i in 0..ql {
                    for j in 0..kl {
                        let computed = match kind {
                            Seen::All => true,
                            Seen::Causal => j <= i,
                            Seen::Masked => seen(q0 + i, k0 + j),
                        };
                        prop_assert!(!computed || seen(q0 + i, k0 + j), "{kind:?} tile computes an unseen pair");
                        covered[((q0 + i) * key.len + k0 + j) as usize] += u8::from(computed);
                    }
                }
            }
            for i in 0..query.len {
                for j in 0..key.len {
                    prop_assert_eq!(covered[(i * key.len + j) as usize], u8::from(seen(i, j)), "pair {} {}", i, j);
                }
            }
        }
    }
}
