//! Execution across ranks, as engine schedules: data parallelism ([`DataParallel`]), the
//! ZeRO family ([`zero::Zero`]: zero1, zero2, fsdp) and, beside either, tensor parallelism
//! ([`tensor::TensorGroup`]): data and ZeRO groups then join the ranks of one tensor
//! coordinate; expert parallelism's token exchange (`experts::ExpertGroup`) and context
//! parallelism's attention (`context::ContextGroup`).
//!
//! Owns: turning a validated [`Strategy`] and a communicator into an engine with the right
//! schedule and process groups, and a rank's trainer over its engines ([`build_trainer`]);
//! pipeline parallelism ([`pipeline`]: schedules, stage split, step executor), and the
//! measurements of the device room a step needs beside model states
//! ([`measure_non_model`], [`measure_shard_floor`]). Must not touch model definitions or
//! optimizer policy.
pub mod context;
mod ddp;
mod experts;
mod mesh;
pub mod pipeline;
pub mod tensor;
mod trainer;
pub mod zero;

pub use context::{piece_of, rows_piece};
pub use ddp::{DataParallel, DataParallelOptions, ExpertReplicas, DEFAULT_BUCKET_BYTES};
pub use mesh::Mesh;
pub use trainer::{build_trainer, TrainerSetup};

use crate::comm::{all_reduce_values, Comm, ProcessGroup, ReduceOp};
use crate::compute::fp8::Fp8Unit;
use crate::compute::replace::Replacements;
use crate::compute::UnitCompute;
use crate::engine::offload::{HostMemory, NonModelTrace, Offload, OffloadOptions};
use crate::engine::placement::HomePolicy;
use crate::engine::{ActivationOffload, Engine, EngineConfig};
use crate::model::ModelSpec;
use crate::strategy::{
    select_units, AmpConfig, ContextKind, Dim, Method, OffloadConfig, OffloadPolicy, OffloadTarget, ShardMethod,
    ShardingStrategy, Stage, Strategy,
};
use crate::train::Feed;
use crate::{Error, Result};
use std::sync::Arc;
use zero::{ApartExperts, ShardGroups, ShardHomes, ShardOffload, Zero, ZeroOptions};

/// How ranks are laid out for a strategy: the communicator (none for one process) and the
/// ranks of one node (the shard group of HYBRID_SHARD by default).
#[derive(Clone)]
pub struct RankLayout<'a> {
    /// The communicator over the job's ranks; `None` for one process.
    pub comm: Option<&'a Comm>,
    /// Ranks on one node (HYBRID_SHARD's shard group by default).
    pub local_world_size: usize,
    /// Data parallelism's buckets and unused-parameter policy.
    pub data_parallel: DataParallelOptions,
    /// The engine is one pipeline stage's (its groups span the ranks of that stage).
    pub stage: bool,
    /// Bytes of optimizer state per trainable parameter element
    /// ([`crate::optim::OptimizerConfig::state_bytes_per_element`]), for placing states
    /// before the optimizer exists.
    pub optimizer_bytes_per_element: u64,
    /// Per moment of a step, device bytes beside model states ([`measure_non_model`]):
    /// what offload's plan leaves room for (`None`: nothing).
    pub non_model: Option<Vec<u64>>,
    /// Beside a ZeRO stage, the device bytes a step needs at its peak with every shard on
    /// the host ([`measure_shard_floor`]): `offload`'s `auto` keeps on the device the shard
    /// states that fit in the budget above it (`None`: not measured, and `auto` under a
    /// budget is refused).
    pub shard_floor: Option<u64>,
}

impl<'a> RankLayout<'a> {
    /// One process, no communication.
    pub fn single() -> RankLayout<'static> {
        RankLayout {
            comm: None,
            local_world_size: 1,
            data_parallel: DataParallelOptions::default(),
            stage: false,
            optimizer_bytes_per_element: crate::optim::OptimizerConfig::default().state_bytes_per_element(),
            non_model: None,
            shard_floor: None,
        }
    }

    /// This placement with the room beside model states measured on `step`
    /// ([`measure_non_model`]) where `strategy`'s offload plan must leave it, or where one
    /// process keeps every state on the device under a budget (so that a step that cannot
    /// fit is refused when the engine is built); beside a ZeRO stage whose `offload` places
    /// shards by the budget, the step's floor ([`measure_shard_floor`]); as it is otherwise.
    pub fn with_room_measured(
        &self,
        spec: ModelSpec,
        config: &EngineConfig,
        strategy: &Strategy,
        step: &crate::data::Step,
        feed: &Feed,
    ) -> Result<RankLayout<'a>> {
        let mut at = self.clone();
        let resident_under_budget = strategy.offload().is_none()
            && strategy.sharding().is_none()
            && config.device_budget.is_some()
            && self.world_size() == 1
            && !self.stage;
        if strategy.offload_plan().is_some() || resident_under_budget {
            at.non_model = Some(measure_non_model(spec, config.clone(), strategy, self, step, feed)?);
        } else if strategy.offload().is_some_and(|o| o.policy == OffloadPolicy::Auto) && config.device_budget.is_some()
        {
            at.shard_floor = Some(measure_shard_floor(spec, config.clone(), strategy, self, step, feed)?);
        }
        Ok(at)
    }

    fn world_size(&self) -> usize {
        self.comm.map_or(1, Comm::size)
    }

    /// The mesh `strategy` makes of this layout's ranks, seen from this rank.
    pub fn mesh(&self, strategy: &Strategy) -> Result<Mesh> {
        mesh_of(strategy, self.comm, self.local_world_size)
    }
}

/// The mesh `strategy` makes of `comm`'s ranks (one process without), seen from this rank;
/// `local_world_size` ranks share a host.
pub fn mesh_of(strategy: &Strategy, comm: Option<&Comm>, local_world_size: usize) -> Result<Mesh> {
    Mesh::new(strategy, comm.map_or(1, Comm::size), comm.map_or(0, Comm::rank), local_world_size)
}

/// Builds the engine for `spec` as `strategy` says: sharded by zero1/zero2/fsdp, data
/// parallel over every rank otherwise (with more than one rank), resident on one; in
/// `half`'s dtype; with each unit's compute methods (amp_native, fp8, checkpoint,
/// module_replace). The loss scaling goes to the trainer: [`Strategy::grad_scaling`].
/// With `lora`, `spec` must hold the adapters ([`crate::strategy::LoraConfig::apply`]).
pub fn build_engine(spec: ModelSpec, config: EngineConfig, strategy: &Strategy, at: &RankLayout) -> Result<Engine> {
    if strategy.lora().is_some() && spec.adapters.is_empty() {
        return Err(Error::Config(
            "lora: the model has no adapters; join them to its description first (LoraConfig::apply)".into(),
        ));
    }
    // An adapter's dropout mask falls at its input's positions in the whole rows, which a
    // rank holding a piece of the sequence does not know here.
    let split_rows =
        strategy.tensor_parallel().is_some_and(|c| c.sequence_parallel) || strategy.context_parallel().is_some();
    if split_rows && spec.adapters.values().any(|a| a.dropout > 0.0) {
        return Err(Error::Config(
            "lora: dropout beside sequence_parallel or context_parallel is not supported: set dropout to 0".into(),
        ));
    }
    // A model's dropout masks fall at positions counted from a row's start; a context
    // ring's piece is two runs apart in the row, which one offset does not place.
    if spec.dropout && strategy.context_parallel().is_some() {
        return Err(Error::Config(
            "context_parallel: the model's dropout is not drawn over a piece of the rows: set --dropout 0".into(),
        ));
    }
    let config = EngineConfig { kind: strategy.half().unwrap_or(config.kind), ..config };
    let policies = compute_policies(&spec, strategy, config.device)?;
    let offloaded = activation_offload(&spec, strategy)?;
    static ON_THE_CPU: std::sync::Once = std::sync::Once::new();
    if config.device == tch::Device::Cpu && offloaded.iter().any(Option::is_some) {
        ON_THE_CPU.call_once(|| {
            tracing::warn!(
                "activation_offload on the CPU moves kept values out of libtorch's allocator, not out of memory"
            )
        });
    }
    let mut engine = build_sharding(spec, config, strategy, at)?;
    engine.set_compute(policies)?;
    engine.set_activation_offload(offloaded)?;
    engine.set_chunked_loss(strategy.chunked_loss().map(|c| c.positions))?;
    let moves_biases = engine.spec().load_balance.as_ref().is_some_and(|b| !b.moving_biases().is_empty());
    if let Some(comm) = at.comm.filter(|c| c.size() > 1 && (strategy.fp8().is_some() || moves_biases)) {
        engine.set_job_group(Some(Arc::from(comm.world()?)));
    }
    Ok(engine)
}

/// Each unit's compute policy under `strategy`.
fn compute_policies(spec: &ModelSpec, strategy: &Strategy, device: tch::Device) -> Result<Vec<UnitCompute>> {
    let autocast = strategy.amp().map(AmpConfig::kind).transpose()?;
    let replacements = strategy.module_replace().map(Replacements::select).transpose()?.unwrap_or_default();
    let recompute = match strategy.checkpoint() {
        Some(c) => select_units(spec, &c.wrap_class, "checkpoint")?,
        None => vec![false; spec.units.len()],
    };
    let fp8 = strategy.fp8().filter(|_| fp8_supported(device));
    Ok(recompute
        .into_iter()
        .map(|recompute| UnitCompute {
            autocast,
            device_autocast: device.is_cuda(),
            replacements: replacements.clone(),
            fp8: fp8.map(|c| Fp8Unit::new(c.clone())),
            recompute,
        })
        .collect())
}

/// Per unit, how `activation_offload` offloads the values it keeps: the units named, or
/// every unit but the last, whose backward follows its forward at once.
fn activation_offload(spec: &ModelSpec, strategy: &Strategy) -> Result<Vec<Option<ActivationOffload>>> {
    let Some(c) = strategy.activation_offload() else { return Ok(vec![None; spec.units.len()]) };
    let chosen = match c.wrap_class.as_slice() {
        [] => (0..spec.units.len()).map(|k| k + 1 < spec.units.len()).collect(),
        named => select_units(spec, named, "activation_offload")?,
    };
    let settings = ActivationOffload { min_bytes: c.min_bytes, pin_memory: c.pin_memory };
    Ok(chosen.into_iter().map(|on| on.then_some(settings)).collect())
}

/// fp8 matrix products need sm 8.9 or newer on a GPU; on the CPU libtorch emulates them.
fn fp8_supported(device: tch::Device) -> bool {
    match crate::compute::fp8::unsupported_on(device) {
        None => true,
        Some(why) => {
            tracing::warn!("{why}: fp8 is ignored");
            false
        }
    }
}

/// Why a step whose gradients travel between `ranks` ranks is not captured as a CUDA graph.
fn collectives_obstacle(ranks: usize) -> String {
    format!("collectives between {ranks} ranks: each is started and waited for by the host")
}

fn build_sharding(spec: ModelSpec, config: EngineConfig, strategy: &Strategy, at: &RankLayout) -> Result<Engine> {
    let mesh = at.mesh(strategy)?;
    let stages = mesh.size(Dim::Pipeline);
    if stages > 1 && !at.stage {
        return Err(Error::Config(
            "parallel_mode: a pipeline trains one engine per stage: build its trainer with parallel::build_trainer"
                .into(),
        ));
    }
    if let Some(offload) = strategy.offload_plan() {
        return build_offload(spec, config, offload, at);
    }
    if mesh.world() == 1 {
        fits_on_the_device(&spec, &config, at)?;
    }
    let tensor = mesh.size(Dim::Tensor);
    // The ranks that hold the same units and pieces, each list in rank order.
    let replica_lists: Vec<Vec<usize>> = mesh
        .groups(&Mesh::REPLICAS)
        .into_iter()
        .map(|mut ranks| {
            ranks.sort_unstable();
            ranks
        })
        .collect();
    // Every rank creates every group in one order: tensor groups, then the replicas'.
    let (tensor_group, replica_group) = match at.comm.filter(|_| mesh.world() > 1) {
        None => (None, None),
        Some(comm) if tensor == 1 && stages == 1 => (None, Some(Arc::<dyn ProcessGroup>::from(comm.world()?))),
        Some(comm) => {
            let sequence_parallel = strategy.tensor_parallel().is_some_and(|c| c.sequence_parallel);
            let group = match tensor {
                1 => None,
                _ => my_group(comm, &mesh.groups(&[Dim::Tensor]))?
                    .map(|g| Arc::new(tensor::TensorGroup::new(g, sequence_parallel))),
            };
            (group, my_group(comm, &replica_lists)?)
        }
    };
    // Then the expert groups: each sparse layer's all-to-all runs over its rank's.
    let expert_group = match at.comm.filter(|_| mesh.size(Dim::Expert) > 1) {
        Some(comm) => my_group(comm, &mesh.groups(&[Dim::Expert]))?
            .map(|g| Arc::new(experts::ExpertGroup::new(g)) as Arc<dyn crate::model::ExpertExchange>),
        None => None,
    };
    // Then the context groups: attention reaches the rest of each row over its rank's.
    let context_group = match (strategy.context_parallel(), at.comm.filter(|_| mesh.size(Dim::Context) > 1)) {
        (Some(c), Some(comm)) => {
            let split_heads = (c.kind == ContextKind::AllToAll).then_some((tensor * mesh.size(Dim::Context)) as i64);
            spec.check_context_parallel(split_heads)?;
            my_group(comm, &mesh.groups(&[Dim::Context]))?
                .map(|g| Arc::new(context::ContextGroup::new(g, c.kind)) as Arc<dyn crate::model::ContextParallel>)
        }
        _ => None,
    };
    let experts_split = expert_group.is_some();
    let config = EngineConfig {
        tensor: tensor_group.map(|g| g as Arc<dyn crate::model::TensorParallel>),
        experts: expert_group,
        context: context_group,
        ..config
    };
    let Some((name, shard)) = strategy.sharding() else {
        // Without sharding each rank of an expert group stores only the experts it computes,
        // and averages their gradients with the ranks that store the same ones: the data
        // replicas outside its expert group (created last, by every rank alike).
        let experts = match (experts_split, at.comm) {
            (true, Some(comm)) => Some(ExpertReplicas {
                group: my_group(comm, &mesh.groups(&[Dim::Zero, Dim::Data, Dim::Context]))?,
                expert_size: mesh.size(Dim::Expert),
            }),
            _ => None,
        };
        let config = EngineConfig { experts_apart: experts.is_some(), ..config };
        let mut engine = Engine::new(spec, config)?;
        if let Some(group) = replica_group {
            // A rank's own step never reaches the experts other ranks of its group compute.
            let options = DataParallelOptions {
                find_unused_parameters: at.data_parallel.find_unused_parameters || experts_split,
                ..at.data_parallel
            };
            DataParallel::install(&mut engine, group, experts, options)?;
        }
        return Ok(engine);
    };
    let (stage, reshard_after_forward) = shard.stage(name);
    let (param_dtype, reduce_dtype) = shard.mixed_precision.clone().unwrap_or_default().kinds()?;
    let options = ZeroOptions {
        stage,
        reshard_after_forward,
        keep_gathered_in_step: at.stage,
        backward_prefetch: shard.backward_prefetch,
        forward_prefetch: shard.forward_prefetch,
        limit_all_gathers: shard.limit_all_gathers,
        overlap_comm: shard.overlap_comm,
        sync_module_states: shard.sync_module_states,
        release_after_init: shard.release_after_init,
        wrap: shard.wrap(&spec)?,
        param_dtype,
        reduce_dtype,
        offload: strategy.offload().map(|o| zero_offload(name, stage, o, &spec, &config, at)).transpose()?,
    };
    // Shard groups are the mesh's zero groups, with the context ranks beside them unless
    // nothing is to be sharded (context ranks hold the same units and average their
    // gradients, so they shard them as zero ranks do); replicas its data and expert groups,
    // and context under NO_SHARD. The runs of a rank's own experts are averaged over the
    // replicas that store them, without the expert dimension.
    let no_shard = shard.sharding_strategy == Some(ShardingStrategy::NoShard);
    let (shard_dims, replica_dims): (&[Dim], &[Dim]) = match no_shard {
        true => (&[Dim::Zero], &[Dim::Data, Dim::Expert, Dim::Context]),
        false => (&[Dim::Zero, Dim::Context], &[Dim::Data, Dim::Expert]),
    };
    let groups = match at.comm.filter(|_| mesh.world() > 1) {
        None => ShardGroups { shard: None, replicate: None, world: None, experts: None },
        Some(comm) => ShardGroups {
            shard: my_group(comm, &mesh.groups(shard_dims))?,
            replicate: my_group(comm, &mesh.groups(replica_dims))?,
            world: replica_group,
            // Each rank stores its own experts: the ranks storing the same ones are those
            // groups' ranks of its expert rank (created last, by every rank alike).
            experts: match experts_split {
                true => {
                    let without_experts =
                        |dims: &[Dim]| -> Vec<Dim> { dims.iter().copied().filter(|&d| d != Dim::Expert).collect() };
                    let expert_size = mesh.size(Dim::Expert);
                    let replicas = |dims: &[Dim]| -> Result<ExpertReplicas> {
                        Ok(ExpertReplicas { group: my_group(comm, &mesh.groups(&without_experts(dims)))?, expert_size })
                    };
                    Some(ApartExperts { replicate: replicas(replica_dims)?, world: replicas(&Mesh::REPLICAS)? })
                }
                false => None,
            },
        },
    };
    let config = EngineConfig { experts_apart: groups.experts.is_some(), ..config };
    Zero::build(spec, config, groups, options)
}

/// One process with model states placed between device and host by `offload`.
fn build_offload(spec: ModelSpec, config: EngineConfig, offload: &OffloadConfig, at: &RankLayout) -> Result<Engine> {
    if at.world_size() > 1 {
        return Err(Error::Config(
            "offload: over several ranks it combines with zero1, zero2 or fsdp, not with data parallelism".into(),
        ));
    }
    let options = OffloadOptions {
        policy: offload.home_policy()?,
        optimizer_bytes_per_element: at.optimizer_bytes_per_element,
        prefetch: offload.prefetch,
        pin_memory: offload.pin_memory,
        non_model: at.non_model.clone(),
        on_host: select_units(&spec, &offload.host_units, "offload.host_units")?,
        slot_bytes: offload.slot_bytes,
        delayed_update: offload.delayed_update,
    };
    Offload::build(spec, config, options)
}

/// With the room beside model states measured ([`RankLayout::with_room_measured`]) and a
/// device budget, whether one process that keeps every state on the device fits it at every
/// moment of a step: the plan of an offload that moves nothing decides, as it would with
/// offload. Nothing to check without either.
fn fits_on_the_device(spec: &ModelSpec, config: &EngineConfig, at: &RankLayout) -> Result<()> {
    if at.non_model.is_none() || config.device_budget.is_none() {
        return Ok(());
    }
    let options = OffloadOptions {
        policy: HomePolicy::Static { params: 0.0, optimizer: 0.0 },
        optimizer_bytes_per_element: at.optimizer_bytes_per_element,
        prefetch: 0,
        pin_memory: false,
        non_model: at.non_model.clone(),
        on_host: vec![],
        slot_bytes: None,
        delayed_update: false,
    };
    match Offload::plan_for(spec, config, &options) {
        Ok(_) => Ok(()),
        Err(e) => Err(Error::Config(format!("{e}; the offload method places states on the host"))),
    }
}

/// What `offload` asks of the ZeRO stage `stage` (method `name`): which sharded units keep
/// their master shard, gradient shard and optimizer state in host memory, updated there.
/// `static` sends the first units covering `ratio` of those states; `auto` keeps on the
/// device what the budget holds above the step's floor. The stage's own layout decides
/// where parameters are between uses, so `params` must say the same: the shards, which go
/// with their unit, under stage 3; whole on the device otherwise.
fn zero_offload(
    name: ShardMethod,
    stage: Stage,
    c: &OffloadConfig,
    spec: &ModelSpec,
    config: &EngineConfig,
    at: &RankLayout,
) -> Result<ShardOffload> {
    let bad = |why: String| Err(Error::Config(format!("offload with {name}: {why}")));
    if c.delayed_update || c.slot_bytes.is_some() {
        return bad("delayed_update and slot_bytes belong to offload's plan in one process".into());
    }
    let (chosen, policy) = match c.policy {
        OffloadPolicy::Static => (OffloadTarget::Cpu, "static"),
        OffloadPolicy::Auto => (OffloadTarget::Auto, "auto"),
    };
    let word = |t: OffloadTarget| if t == OffloadTarget::Cpu { "\"cpu\"" } else { "\"auto\"" };
    if c.optimizer != chosen {
        return bad(format!(
            "with policy {policy} the shard states' places follow it: optimizer must be {}",
            word(chosen)
        ));
    }
    match (stage, c.params) {
        (Stage::Parameters, p) if p == chosen => {}
        (Stage::Optimizer | Stage::Gradients, OffloadTarget::None) => {}
        (Stage::Parameters, _) => {
            return bad(format!(
                "its parameters between uses are the shards, which go with their unit: params must be {}",
                word(chosen)
            ))
        }
        _ => return bad("whole parameters stay on the device for compute: params must be \"none\"".into()),
    }
    let homes = match c.policy {
        OffloadPolicy::Static => ShardHomes::Static { ratio: c.ratio },
        OffloadPolicy::Auto => ShardHomes::Auto {
            room: match config.device_budget {
                None => None,
                Some(budget) => {
                    let Some(floor) = at.shard_floor else {
                        return bad(
                            "policy auto under a device budget needs the step's floor, measured before the engine \
                             is built (RankLayout::with_room_measured); a pipeline stage has none: use policy static"
                                .into(),
                        );
                    };
                    if floor > budget {
                        return bad(format!(
                            "the model's states do not fit: with every shard on the host a step needs {floor} bytes \
                             of the device at its peak, over its budget of {budget}"
                        ));
                    }
                    Some(budget - floor)
                }
            },
        },
    };
    Ok(ShardOffload {
        memory: HostMemory { device: config.device, pin: c.pin_memory },
        homes,
        forced: select_units(spec, &c.host_units, "offload.host_units")?,
        optimizer_bytes_per_element: at.optimizer_bytes_per_element,
    })
}

/// The device bytes a step of `strategy` (a ZeRO stage beside `offload`) needs at its peak
/// with every shard on the host: measured on an engine built so, without budgets, over two
/// steps on `step`'s batches (so that the update between them, with its refresh of whole
/// parameters from the host, falls inside the trace), as the most model-state bytes the
/// ledger holds on the device at a moment plus the most the allocator held beside model
/// states then ([`NonModelTrace`]); the largest over the ranks, so that every rank places
/// its shards from the same floor.
pub fn measure_shard_floor(
    spec: ModelSpec,
    config: EngineConfig,
    strategy: &Strategy,
    at: &RankLayout,
    step: &crate::data::Step,
    feed: &Feed,
) -> Result<u64> {
    let (Some((name, shard)), Some(offload)) = (strategy.sharding(), strategy.offload()) else {
        return Err(Error::Config("measuring a step's floor needs a ZeRO stage beside offload".into()));
    };
    let params = match shard.stage(name).0 {
        Stage::Parameters => OffloadTarget::Cpu,
        _ => OffloadTarget::None,
    };
    // Nothing page-locked: this engine only measures.
    let on_host = OffloadConfig { params, pin_memory: false, ..offload.everything_on_host() };
    let (mut engine, trace) = traced_engine(spec, config, strategy, at, &on_host)?;
    let optimizer = crate::optim::Optimizer::new(&mut engine, crate::optim::OptimizerConfig::default(), &[])?;
    let mut trainer = crate::train::Trainer::new(engine, optimizer, crate::optim::LrSchedule::Constant, None);
    trainer.set_feed(feed);
    for _ in 0..2 {
        trainer.train_step(step)?;
    }
    let floor = trace.device_peak() as f64;
    match at.comm.filter(|c| c.size() > 1) {
        Some(comm) => Ok(all_reduce_values(comm.world()?.as_ref(), &[floor], ReduceOp::Max)?[0] as u64),
        None => Ok(floor as u64),
    }
}

/// An engine built as `strategy` says but with `offload` for its offload and no budgets,
/// with a [`NonModelTrace`] whose first window starts once it is built (not at a peak of the
/// build or of an earlier engine).
fn traced_engine(
    spec: ModelSpec,
    config: EngineConfig,
    strategy: &Strategy,
    at: &RankLayout,
    offload: &OffloadConfig,
) -> Result<(Engine, Arc<NonModelTrace>)> {
    let mut methods: Vec<Method> =
        strategy.methods.iter().filter(|m| !matches!(m, Method::Offload(_))).cloned().collect();
    methods.push(Method::Offload(offload.clone()));
    let measured = Strategy { methods };
    let config = EngineConfig { device_budget: None, host_budget: None, ..config };
    let mut engine = build_engine(spec, config, &measured, at)?;
    let trace = Arc::new(NonModelTrace::new(&engine));
    engine.set_event_sink(trace.clone());
    crate::engine::memory::reset_allocator_peak(engine.config().device);
    Ok((engine, trace))
}

/// Per moment of a step, the device bytes beside model states that `step`'s forwards and
/// backwards (fed and scored by `feed`) need under `strategy`'s compute methods:
/// measured once on an engine built as `strategy` says but with every state on the host
/// and no budgets, the least the device can hold. Offload's plan leaves room for them
/// ([`RankLayout::non_model`]), so a run within the budget never runs out mid-step.
pub fn measure_non_model(
    spec: ModelSpec,
    config: EngineConfig,
    strategy: &Strategy,
    at: &RankLayout,
    step: &crate::data::Step,
    feed: &Feed,
) -> Result<Vec<u64>> {
    if strategy.sharding().is_some() {
        return Err(Error::Config("measuring room beside model states needs a strategy without a ZeRO stage".into()));
    }
    let offload = strategy.offload_plan().cloned().unwrap_or_default();
    let (mut engine, trace) = traced_engine(spec, config, strategy, at, &offload.everything_on_host())?;
    let loss = feed.loss_of(&engine);
    for (i, batch) in step.micro_batches.iter().enumerate() {
        crate::train::set_rows(&mut engine, batch, Some(crate::train::first_step_draw(batch)));
        let output = engine.forward(&(feed.input)(batch)?)?;
        let weighted =
            crate::train::training_loss(&engine, &loss, &output, batch)?.f_mul_scalar(step.loss_weight(i))?;
        engine.backward(&weighted)?;
    }
    Ok(trace.peaks())
}

/// Creates every group of `lists` (every rank creates every group, in the same order) and
/// returns the one holding this rank, unless it is a group of one.
pub(crate) fn my_group(comm: &Comm, lists: &[Vec<usize>]) -> Result<Option<Arc<dyn ProcessGroup>>> {
    let mut mine = None;
    for ranks in lists.iter().filter(|r| r.len() > 1) {
        mine = mine.or(comm.new_group(ranks)?);
    }
    Ok(mine.map(Arc::<dyn ProcessGroup>::from))
}
