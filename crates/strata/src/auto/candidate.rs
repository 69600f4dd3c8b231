//! The search space: precision, module replacement, sharding, recomputation, the tensor
//! size, the pipeline's shape, the context split and the expert groups, as layouts built from every method minus `excluded` and
//! with every `included` one, and what the device and the world size rule out before
//! anything runs.
//!
//! Owns the candidates, the layouts around them and their translation into strategies.
//! Must not predict memory or run anything: [`super::estimate`] predicts, [`super::search`]
//! tries.
use crate::model::ModelSpec;
use crate::strategy::{ContextKind, ScheduleKind, Strategy};
use crate::Result;
use serde::Serialize;
use tch::Device;

/// How the numbers are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Everything in fp32.
    Fp32,
    /// fp32 parameters, matrix products in bf16 (`amp_native`).
    AmpBf16,
    /// fp32 parameters, matrix products in fp16 (`amp_native`).
    AmpFp16,
    /// The whole model in bf16 (`half`).
    HalfBf16,
    /// The whole model in fp16 (`half`).
    HalfFp16,
    /// fp8 linear layers (head excluded, and those narrower than [`FP8_MIN_FEATURES`]) over
    /// bf16 autocast.
    Fp8,
}

/// The fewest input or output features of a linear layer the search computes in fp8. Below
/// it the casts cost more than the faster product saves: on an H200 the forward fp8 linear
/// (casts included) ran at 0.27× bf16's speed on 2048-wide squares of 2,048 rows, and at
/// 16,384 tokens 1.00–1.44× at 2048 × 5632 and 1.38–1.47× at 4096 × 14336 (`strata bench
/// gpu`), while a 512-wide key or value projection leaves fp8 too little to gain.
pub const FP8_MIN_FEATURES: i64 = 2048;

pub(crate) const PRECISIONS: [Precision; 6] =
    [Precision::Fp32, Precision::AmpBf16, Precision::HalfBf16, Precision::AmpFp16, Precision::HalfFp16, Precision::Fp8];

/// Which model states are split over the ranks that hold the same pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    /// Nothing split: plain data parallelism.
    None,
    /// Optimizer states split (`zero1`).
    Zero1,
    /// Optimizer states and gradients split (`zero2`).
    Zero2,
    /// Parameters, gradients and optimizer states split (`fsdp`).
    Fsdp,
}

const SHARDINGS: [Sharding; 4] = [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp];

/// One point of the search space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Candidate {
    /// How the numbers are computed.
    pub precision: Precision,
    /// Applies the replacement pairs `module_replace` applies without a list.
    pub module_replace: bool,
    /// Which model states are split over the data ranks.
    pub sharding: Sharding,
    /// Recomputes the blocks' activations in backward (`checkpoint`).
    pub checkpoint: bool,
    /// Ranks each unit is split over (with sequence parallel above 1); sharding and data
    /// parallelism span the ranks that hold the same pieces.
    pub tensor: usize,
    /// Model states between device and host, placed against the device budget: `offload`'s
    /// plan in one process, the shard states of whole units beside zero1/zero2/fsdp.
    pub offload: bool,
    /// The output head computes the next-token loss this many positions at a time
    /// (`chunked_loss`): the logits of a micro-batch never exist. `None`: it returns logits.
    pub chunked_loss: Option<i64>,
    /// The values units keep for backward wait in host memory (`activation_offload`), and
    /// recomputed blocks' inputs with them.
    pub activation_offload: bool,
}

impl Candidate {
    /// `precision` with `sharding` and (or not) `checkpoint`, on one tensor rank, with no
    /// replacements, offload or chunked loss: what the other fields are set beside.
    pub fn plain(precision: Precision, sharding: Sharding, checkpoint: bool) -> Candidate {
        Candidate {
            precision,
            module_replace: false,
            sharding,
            checkpoint,
            tensor: 1,
            offload: false,
            chunked_loss: None,
            activation_offload: false,
        }
    }

    /// The method names the candidate uses.
    pub fn methods(&self) -> Vec<&'static str> {
        let mut m = vec!["parallel_mode"];
        m.extend(match self.precision {
            Precision::Fp32 => &[][..],
            Precision::AmpBf16 | Precision::AmpFp16 => &["amp_native"],
            Precision::HalfBf16 | Precision::HalfFp16 => &["half"],
            Precision::Fp8 => &["fp8", "amp_native"],
        });
        if self.module_replace {
            m.push("module_replace");
        }
        if self.checkpoint {
            m.push("checkpoint");
        }
        if self.chunked_loss.is_some() {
            m.push("chunked_loss");
        }
        if self.tensor > 1 {
            m.push("tensor_parallel");
        }
        m.extend(match self.sharding {
            Sharding::None => None,
            Sharding::Zero1 => Some("zero1"),
            Sharding::Zero2 => Some("zero2"),
            Sharding::Fsdp => Some("fsdp"),
        });
        if self.offload {
            m.push("offload");
        }
        if self.activation_offload {
            m.push("activation_offload");
        }
        m
    }

    /// The candidate as a strategy; `blocks` are the unit kinds recomputed by `checkpoint`.
    pub fn strategy(&self, blocks: &[String]) -> Result<Strategy> {
        self.strategy_with_pipeline(blocks, None, None, 1)
    }

    /// [`Candidate::strategy`] over `pipeline` stages (with their schedule and chunks per
    /// rank) where given, the stages balanced by parameters, and over `context` ranks (with
    /// their exchange) where given.
    fn strategy_with_pipeline(
        &self,
        blocks: &[String],
        pipeline: Option<(usize, ScheduleKind, usize)>,
        context: Option<(usize, ContextKind)>,
        experts: usize,
    ) -> Result<Strategy> {
        // Tensor groups innermost (their collectives are the busiest), then context groups,
        // then expert groups (an all-to-all per sparse layer), all within a node where they fit.
        let mut dims = vec![];
        if self.tensor > 1 {
            dims.push(serde_json::json!(["tensor", self.tensor]));
        }
        if let Some((size, _)) = context {
            dims.push(serde_json::json!(["context", size]));
        }
        if experts > 1 {
            dims.push(serde_json::json!(["expert", experts]));
        }
        if let Some((stages, _, _)) = pipeline {
            dims.push(serde_json::json!(["pipeline", stages]));
        }
        let mut items = match dims.is_empty() {
            true => vec![serde_json::json!("parallel_mode")],
            false => vec![serde_json::json!(["parallel_mode", [dims, null]])],
        };
        if self.tensor > 1 {
            items.push(serde_json::json!(["tensor_parallel", {"sequence_parallel": true}]));
        }
        if let Some((_, kind)) = context {
            items.push(serde_json::json!(["context_parallel", {"kind": kind}]));
        }
        if experts > 1 {
            items.push(serde_json::json!("expert_parallel"));
        }
        if let Some((_, schedule, virtual_stages)) = pipeline {
            items.push(serde_json::json!(["pipeline_parallel", {
                "schedule": schedule, "virtual_stages": virtual_stages, "balance": "parameters"
            }]));
        }
        items.extend(match self.precision {
            Precision::Fp32 => vec![],
            Precision::AmpBf16 => vec![serde_json::json!(["amp_native", {"dtype": "bf16"}])],
            Precision::AmpFp16 => vec![serde_json::json!(["amp_native", {"dtype": "fp16"}])],
            Precision::HalfBf16 => vec![serde_json::json!(["half", "bf16"])],
            Precision::HalfFp16 => vec![serde_json::json!(["half", "fp16"])],
            Precision::Fp8 => vec![
                serde_json::json!(["fp8", {"exclude": ["lm_head"], "min_features": FP8_MIN_FEATURES}]),
                serde_json::json!(["amp_native", {"dtype": "bf16"}]),
            ],
        });
        if self.module_replace {
            items.push(serde_json::json!("module_replace"));
        }
        if self.checkpoint {
            items.push(serde_json::json!(["checkpoint", blocks]));
        }
        if let Some(positions) = self.chunked_loss {
            items.push(serde_json::json!(["chunked_loss", {"positions": positions}]));
        }
        if let Some(name) = self.methods().iter().find(|m| ["zero1", "zero2", "fsdp"].contains(m)) {
            items.push(serde_json::json!(name));
        }
        if self.offload {
            // One process: the plan against the budget; beside a ZeRO stage, its shards.
            items.push(match self.sharding {
                Sharding::None => serde_json::json!("offload"),
                Sharding::Fsdp => {
                    serde_json::json!(["offload", {"params": "auto", "optimizer": "auto", "policy": "auto"}])
                }
                _ => serde_json::json!(["offload", {"params": "none", "optimizer": "auto", "policy": "auto"}]),
            });
        }
        if self.activation_offload {
            items.push(serde_json::json!("activation_offload"));
        }
        Strategy::from_value(&serde_json::Value::Array(items))
    }

    /// Short readable name: the methods joined by ` + `.
    pub fn label(&self) -> String {
        let mut parts = vec![match self.precision {
            Precision::Fp32 => "fp32",
            Precision::AmpBf16 => "amp bf16",
            Precision::AmpFp16 => "amp fp16",
            Precision::HalfBf16 => "half bf16",
            Precision::HalfFp16 => "half fp16",
            Precision::Fp8 => "fp8 + amp bf16",
        }];
        if self.module_replace {
            parts.push("module_replace");
        }
        if self.checkpoint {
            parts.push("checkpoint");
        }
        if self.chunked_loss.is_some() {
            parts.push("chunked loss");
        }
        let tensor = format!("tensor {} + sequence parallel", self.tensor);
        if self.tensor > 1 {
            parts.push(&tensor);
        }
        parts.push(match self.sharding {
            Sharding::None => "data parallel",
            Sharding::Zero1 => "zero1",
            Sharding::Zero2 => "zero2",
            Sharding::Fsdp => "fsdp",
        });
        if self.offload {
            parts.push("offload");
        }
        if self.activation_offload {
            parts.push("activation offload");
        }
        parts.join(" + ")
    }
}

/// Where and how a model runs: the methods of a [`Candidate`] plus the pipeline's shape.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Layout {
    /// The methods besides the pipeline.
    pub candidate: Candidate,
    /// Pipeline stages (1: none).
    pub pipeline: usize,
    /// The pipeline's schedule (unused at 1 stage).
    pub schedule: ScheduleKind,
    /// Chunks per rank of the interleaved schedule (1 otherwise).
    pub virtual_stages: usize,
    /// Ranks each row's positions are split over (context parallelism; 1: none).
    pub context: usize,
    /// How context parallelism's attention reaches the other ranks' positions.
    pub context_kind: ContextKind,
    /// Ranks of an expert group (expert parallelism; 1: none): carved out of the data
    /// ranks, each storing and computing its share of every sparse layer's routed experts.
    pub experts: usize,
}

impl Layout {
    /// `candidate` without a pipeline.
    pub fn new(candidate: Candidate) -> Layout {
        Layout {
            candidate,
            pipeline: 1,
            schedule: ScheduleKind::OneForwardOneBackward,
            virtual_stages: 1,
            context: 1,
            context_kind: ContextKind::Ring,
            experts: 1,
        }
    }

    /// The same layout with each sparse layer's experts split over expert groups of `size`
    /// of its data ranks (no split at 1).
    pub fn with_experts(self, size: usize) -> Layout {
        Layout { experts: size.max(1), ..self }
    }

    /// The same layout with each row's positions split over `size` ranks, exchanged by
    /// `kind` (no split at 1).
    pub fn with_context(self, size: usize, kind: ContextKind) -> Layout {
        Layout { context: size.max(1), context_kind: kind, ..self }
    }

    /// `candidate` over `pipeline` stages run by 1F1B (no pipeline at 1).
    pub fn piped(candidate: Candidate, pipeline: usize) -> Layout {
        Layout { pipeline: pipeline.max(1), ..Layout::new(candidate) }
    }

    /// Ranks holding the same pieces of the model and reading different rows: what data
    /// parallelism and sharding span (context ranks read the same rows).
    pub fn data_ranks(&self, ranks: usize) -> usize {
        ranks / (self.candidate.tensor.max(1) * self.pipeline.max(1) * self.context.max(1))
    }

    /// Ranks a ZeRO stage shards the same pieces over: the data ranks and the context ranks
    /// beside them (which hold the same units), outside the expert groups (whose ranks store
    /// different experts).
    pub fn shard_ranks(&self, ranks: usize) -> usize {
        self.data_ranks(ranks) * self.context.max(1) / self.experts.max(1)
    }

    /// Ranks that read different rows or pieces of them and average their gradients: the
    /// data ranks (expert groups included) and the context ranks.
    pub fn replicas(&self, ranks: usize) -> usize {
        self.data_ranks(ranks) * self.context.max(1)
    }

    /// The method names the layout uses.
    pub fn methods(&self) -> Vec<&'static str> {
        let mut m = self.candidate.methods();
        if self.pipeline > 1 {
            m.push("pipeline_parallel");
        }
        if self.context > 1 {
            m.push("context_parallel");
        }
        if self.experts > 1 {
            m.push("expert_parallel");
        }
        m
    }

    /// The layout as a strategy, the stages balanced by parameters; `blocks` are the unit
    /// kinds recomputed by `checkpoint`.
    pub fn strategy(&self, blocks: &[String]) -> Result<Strategy> {
        let pipeline = (self.pipeline > 1).then_some((self.pipeline, self.schedule, self.virtual_stages));
        let context = (self.context > 1).then_some((self.context, self.context_kind));
        self.candidate.strategy_with_pipeline(blocks, pipeline, context, self.experts)
    }

    /// [`Candidate::label`], plus the stages and schedule where there is a pipeline, the
    /// context split and the expert groups where there are.
    pub fn label(&self) -> String {
        let mut label = match self.pipeline {
            1 => self.candidate.label(),
            p => format!("{} + pipeline {p} ({})", self.candidate.label(), strategy_name(self.schedule)),
        };
        if self.context > 1 {
            label += &format!(" + context {} ({})", self.context, strategy_name(self.context_kind));
        }
        if self.experts > 1 {
            label += &format!(" + experts {}", self.experts);
        }
        label
    }
}

/// The name strategies spell `value` by (a schedule, a context kind).
fn strategy_name(value: impl Serialize) -> String {
    serde_json::to_value(value).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}

/// The sizes a search tries in each dimension beyond 1: tensor sizes the model splits
/// over, pipeline sizes that leave every stage a unit, expert group sizes its experts split
/// over (none for a dense model).
#[derive(Clone, Copy, Debug, Default)]
pub struct Sizes<'a> {
    /// Tensor sizes above 1.
    pub tensor: &'a [usize],
    /// Pipeline sizes above 1.
    pub pipeline: &'a [usize],
    /// Expert group sizes above 1.
    pub experts: &'a [usize],
}

/// The candidates: every combination of the methods that exist, at tensor size 1 and each
/// of `sizes.tensor` (those the model splits over at this world size), without a pipeline
/// and over each of `sizes.pipeline` (1F1B), without expert groups and over each of
/// `sizes.experts`, with and without offload where `offload` says it is worth trying (a
/// device budget), minus those using an `excluded` method, keeping only those using every
/// `included` one.
pub fn candidates(
    excluded: &[String],
    included: &[String],
    has_blocks: bool,
    sizes: Sizes<'_>,
    offload: bool,
) -> Vec<Layout> {
    let offloads: &[bool] = if offload { &[false, true] } else { &[false] };
    let mut out = Vec::new();
    let above_one = |sizes: &[usize]| -> Vec<usize> {
        std::iter::once(1).chain(sizes.iter().copied().filter(|&t| t > 1)).collect()
    };
    let mut shapes = vec![];
    for experts in above_one(sizes.experts) {
        for pipeline in above_one(sizes.pipeline) {
            shapes.extend(above_one(sizes.tensor).into_iter().map(|tensor| (experts, pipeline, tensor)));
        }
    }
    for (experts, pipeline, tensor) in shapes {
        for precision in PRECISIONS {
            for module_replace in [true, false] {
                for sharding in SHARDINGS {
                    for (checkpoint, &offload) in
                        [false, true].into_iter().flat_map(|c| offloads.iter().map(move |o| (c, o)))
                    {
                        if checkpoint && !has_blocks {
                            continue;
                        }
                        let c = Candidate {
                            precision,
                            module_replace,
                            sharding,
                            checkpoint,
                            tensor,
                            offload,
                            chunked_loss: None,
                            activation_offload: false,
                        };
                        let layout = Layout::piped(c, pipeline).with_experts(experts);
                        let methods = layout.methods();
                        if methods.iter().any(|m| excluded.iter().any(|e| e == m)) {
                            continue;
                        }
                        if included.iter().all(|i| methods.contains(&i.as_str())) {
                            out.push(layout);
                        }
                    }
                }
            }
        }
    }
    out
}

/// One layout of every rank shape a dry run on `world` ranks may take: each tensor, pipeline
/// and context size (by each exchange rows of `ctx` positions allow) dividing the world,
/// and each of `expert_sizes` dividing the data ranks they leave, laid out as the
/// candidates' strategies lay them out. The batches a rank reads depend on its shape alone.
pub(crate) fn batch_shapes(world: usize, ctx: usize, expert_sizes: &[usize]) -> Vec<Layout> {
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = vec![];
    for tensor in divisors(world) {
        for pipeline in divisors(world / tensor) {
            for context in divisors(world / (tensor * pipeline)) {
                let kinds: Vec<ContextKind> = match context {
                    1 => vec![ContextKind::Ring],
                    c => [(ContextKind::Ring, 2 * c), (ContextKind::AllToAll, c)]
                        .into_iter()
                        .filter(|(_, runs)| ctx.is_multiple_of(*runs))
                        .map(|(kind, _)| kind)
                        .collect(),
                };
                let data = world / (tensor * pipeline * context);
                let shape = Candidate { tensor, ..Candidate::plain(Precision::Fp32, Sharding::None, false) };
                for kind in kinds {
                    for experts in std::iter::once(1).chain(expert_sizes.iter().copied()) {
                        if data.is_multiple_of(experts) {
                            out.push(Layout::piped(shape, pipeline).with_context(context, kind).with_experts(experts));
                        }
                    }
                }
            }
        }
    }
    out
}

/// The ways rows of `seq_len` positions split over `c` context ranks beside tensor size `t`
/// that `spec` takes: the ring (rows in `2c` runs) and, where the heads divide over
/// `t · c`, the all-to-all.
pub(crate) fn context_kinds(spec: &ModelSpec, seq_len: i64, t: usize, c: usize) -> Vec<ContextKind> {
    let mut kinds = vec![];
    if seq_len % (2 * c as i64) == 0 && spec.check_context_parallel(None).is_ok() {
        kinds.push(ContextKind::Ring);
    }
    if seq_len % c as i64 == 0 && spec.check_context_parallel(Some((t * c) as i64)).is_ok() {
        kinds.push(ContextKind::AllToAll);
    }
    kinds
}

/// Why `c` cannot run here, if it cannot: the device lacks fast kernels for it, or its
/// shape cannot run on `world` ranks ([`shape_obstacle`]).
pub fn capability(layout: &Layout, device: Device, world: usize) -> Option<String> {
    let c = &layout.candidate;
    let fp16 = matches!(c.precision, Precision::AmpFp16 | Precision::HalfFp16);
    match device {
        Device::Cpu if fp16 => {
            return Some("fp16 products on the CPU run no faster than fp32 (bf16 is its fast half precision)".into())
        }
        Device::Cpu if c.precision == Precision::Fp8 => return Some("fp8 products are emulated on the CPU".into()),
        _ if c.precision == Precision::Fp8 => {
            if let Some(why) = crate::compute::fp8::unsupported_on(device) {
                return Some(why);
            }
        }
        _ => {}
    }
    shape_obstacle(layout, world)
}

/// Why `layout` cannot run on `world` ranks on any device, if it cannot: its sizes do not
/// divide the ranks, its methods do not combine, or there is nothing to shard.
pub fn shape_obstacle(layout: &Layout, world: usize) -> Option<String> {
    let c = &layout.candidate;
    if c.tensor > 1 && !world.is_multiple_of(c.tensor) {
        return Some(format!("tensor size {} does not divide the {world} ranks", c.tensor));
    }
    if !world.is_multiple_of(c.tensor * layout.pipeline * layout.context.max(1)) {
        return Some(format!(
            "tensor {} × pipeline {} × context {} ranks do not divide the {world} ranks",
            c.tensor,
            layout.pipeline,
            layout.context.max(1)
        ));
    }
    if layout.experts > 1 && !layout.data_ranks(world).is_multiple_of(layout.experts) {
        return Some(format!(
            "expert groups of {} ranks do not divide the {} data ranks",
            layout.experts,
            layout.data_ranks(world)
        ));
    }
    if c.offload && layout.pipeline > 1 {
        return Some("offload does not combine with pipeline parallelism".into());
    }
    if c.offload && c.tensor > 1 {
        return Some("offload does not combine with tensor parallelism".into());
    }
    if c.offload && c.sharding == Sharding::None && world > 1 {
        return Some("offload over several ranks goes with zero1, zero2 or fsdp".into());
    }
    // ZeRO stages shard over the context ranks beside the data ranks.
    (layout.shard_ranks(world) == 1 && c.sharding != Sharding::None).then(|| "nothing to shard on one rank".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Sizes<'static> = Sizes { tensor: &[], pipeline: &[], experts: &[] };

    #[test]
    fn candidates_cover_every_method_and_honour_included_and_excluded() {
        let all = candidates(&[], &[], true, NONE, false);
        assert_eq!(all.len(), PRECISIONS.len() * 2 * SHARDINGS.len() * 2);
        assert_eq!(candidates(&[], &[], true, Sizes { tensor: &[2, 4], ..NONE }, false).len(), 3 * all.len());
        assert_eq!(
            candidates(&[], &[], true, Sizes { tensor: &[2], pipeline: &[2, 4], ..NONE }, false).len(),
            6 * all.len()
        );
        let offloading = candidates(&[], &[], true, NONE, true);
        assert_eq!(offloading.len(), 2 * all.len(), "with and without offload under a budget");
        for l in offloading.iter().filter(|l| l.candidate.offload) {
            let s = l.strategy(&["GptBlock".into()]).unwrap();
            assert!(s.offload().is_some(), "{}", l.label());
            assert_eq!(s.offload_plan().is_some(), l.candidate.sharding == Sharding::None, "{}", l.label());
        }
        for l in &all {
            let s = l.strategy(&["GptBlock".into()]).unwrap();
            let names: Vec<&str> = s.methods.iter().map(|m| m.name()).collect();
            assert_eq!(names.len(), l.methods().len(), "{}", l.label());
        }
        let some = candidates(
            &["fsdp".into()],
            &["checkpoint".into(), "amp_native".into()],
            true,
            Sizes { tensor: &[2], ..NONE },
            false,
        );
        assert!(!some.is_empty());
        assert!(some.iter().all(|l| l.candidate.checkpoint
            && l.candidate.sharding != Sharding::Fsdp
            && l.methods().contains(&"amp_native")));
        assert!(
            candidates(&[], &["checkpoint".into()], false, NONE, false).is_empty(),
            "nothing to recompute without repeated units"
        );
        let cpu = Candidate::plain(Precision::HalfFp16, Sharding::None, false);
        let at = |c: Candidate, world| capability(&Layout::new(c), Device::Cpu, world);
        assert!(at(cpu, 1).is_some());
        let shard = Candidate { precision: Precision::Fp32, sharding: Sharding::Zero2, ..cpu };
        assert_eq!(at(shard, 1).as_deref(), Some("nothing to shard on one rank"));
        assert!(at(shard, 2).is_none());
        let split = Candidate { tensor: 2, ..shard };
        assert_eq!(at(split, 2).as_deref(), Some("nothing to shard on one rank"));
        let scored = Candidate { chunked_loss: Some(64), precision: Precision::Fp32, ..cpu };
        assert!(at(scored, 1).is_none() && at(Candidate { tensor: 2, ..scored }, 2).is_none());
        let names: Vec<&str> = Layout::new(scored).strategy(&[]).unwrap().methods.iter().map(|m| m.name()).collect();
        assert_eq!(names, ["parallel_mode", "chunked_loss"]);
        assert!(at(split, 4).is_none());
        let offloaded = Candidate { offload: true, precision: Precision::Fp32, ..cpu };
        assert!(at(offloaded, 1).is_none());
        assert!(at(offloaded, 2).is_some_and(|why| why.contains("zero1, zero2 or fsdp")));
        let tensor_only = candidates(&[], &["tensor_parallel".into()], true, Sizes { tensor: &[2], ..NONE }, false);
        assert!(!tensor_only.is_empty() && tensor_only.iter().all(|l| l.candidate.tensor == 2));
        let strategy = tensor_only[0].strategy(&[]).unwrap();
        assert_eq!(strategy.parallel_mode().size(crate::strategy::Dim::Tensor, 4).unwrap(), 2);
        assert!(strategy.tensor_parallel().is_some_and(|t| t.sequence_parallel));
    }

    /// Every layout the search can try reads batches a rank's shape of
    /// [`batch_shapes`] prepared: the same share of the batch and piece of the rows on every
    /// rank, expert groups beside stages and tensor groups included.
    #[test]
    fn every_candidate_reads_the_batches_of_a_prepared_shape() {
        use crate::parallel::Mesh;
        let (world, ctx, experts) = (4, 8, [2, 4]);
        let sizes = Sizes { tensor: &[2, 4], pipeline: &[2, 4], experts: &experts };
        let shapes = batch_shapes(world, ctx, &experts);
        let mut layouts: Vec<Layout> = candidates(&[], &[], true, sizes, false);
        let split =
            layouts.iter().flat_map(|l| [2, 4].map(|c| l.with_context(c, ContextKind::Ring))).collect::<Vec<_>>();
        layouts.extend(split);
        let key = |l: &Layout, rank: usize| {
            let strategy = l.strategy(&["GptBlock".into()]).unwrap();
            crate::auto::bench::batch_key(&Mesh::new(&strategy, world, rank, world).unwrap(), &strategy)
        };
        let mut checked = 0;
        for l in layouts.iter().filter(|l| shape_obstacle(l, world).is_none()) {
            for rank in 0..world {
                let k = key(l, rank);
                assert!(shapes.iter().any(|s| key(s, rank) == k), "{} on rank {rank}", l.label());
            }
            checked += (l.experts > 1 && l.pipeline > 1) as usize;
        }
        assert!(checked > 0);
    }

    /// Pipeline sizes are a dimension: they divide the ranks with the tensor size, leave
    /// the rest to data parallelism and sharding, and write `pipeline_parallel`.
    #[test]
    fn pipelines_are_layouts_of_their_own() {
        let piped = candidates(
            &[],
            &["pipeline_parallel".into()],
            true,
            Sizes { tensor: &[2], pipeline: &[2, 4], ..NONE },
            false,
        );
        assert!(!piped.is_empty() && piped.iter().all(|l| l.pipeline > 1));
        let sharded = piped
            .iter()
            .find(|l| l.pipeline == 2 && l.candidate.tensor == 1 && l.candidate.sharding == Sharding::Fsdp)
            .unwrap();
        assert!(capability(sharded, Device::Cpu, 4).is_none(), "two replicas of two stages shard");
        assert_eq!(capability(sharded, Device::Cpu, 2).as_deref(), Some("nothing to shard on one rank"));
        let both = piped.iter().find(|l| l.pipeline == 4 && l.candidate.tensor == 2).unwrap();
        assert!(capability(both, Device::Cpu, 4).is_some_and(|why| why.contains("do not divide")));
        let s = sharded.strategy(&["GptBlock".into()]).unwrap();
        assert_eq!(s.parallel_mode().size(crate::strategy::Dim::Pipeline, 4).unwrap(), 2);
        assert!(s.pipeline_parallel().is_some());
        assert!(sharded.label().ends_with("pipeline 2 (1f1b)"), "{}", sharded.label());
        let offloaded = Layout::piped(Candidate { offload: true, ..sharded.candidate }, 2);
        assert!(capability(&offloaded, Device::Cpu, 4).is_some_and(|why| why.contains("pipeline")));
        assert!(candidates(&["pipeline_parallel".into()], &[], true, Sizes { pipeline: &[2], ..NONE }, false)
            .iter()
            .all(|l| l.pipeline == 1));
    }
}
