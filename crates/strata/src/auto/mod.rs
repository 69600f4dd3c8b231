//! `auto_accelerate`: from a model function, an optimizer, a dataset and a loss, a
//! prepared training run — with a strategy given (semi-automatic: `load_strategy`,
//! optionally fine-tuned by short dry runs) or found (fully automatic: the search of
//! [`search`]). Failures come back as `status: false` with the reason, never a panic.
//!
//! Owns: the choice of strategy and the assembly of engine, optimizer, data loader and
//! trainer for it. Must not own how a strategy executes (`parallel`, `compute` do).
pub mod bench;
pub mod calibrate;
pub mod candidate;
pub mod cost;
pub mod estimate;
pub mod plan;
pub mod search;
pub mod step_time;

use crate::comm::{Comm, ProcessGroup};
use crate::data::{Batching, DataLoader, Dataset, LoaderConfig};
use crate::engine::EngineConfig;
use crate::model::Builder;
use crate::optim::{GroupRule, LrSchedule, OptimizerConfig};
use crate::parallel::{self, DataParallelOptions, Mesh, RankLayout, DEFAULT_BUCKET_BYTES};
use crate::strategy::{BackwardPrefetch, ChunkedLossConfig, LoraConfig, Method, ShardMethod, Strategy, StrategySource};
use crate::train::{token_input, Feed, InputFn, LossFn, Trainer};
use crate::{Error, Result};
use bench::Bench;
pub use candidate::{Candidate, Layout};
use cost::{Analysis, JobShape, Predictor};
pub use search::{Measure, SearchMode, SearchReport};
use search::{Outcome, Search, SearchLimits};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The options of `auto_accelerate` beyond the job itself (ATorch's names).
#[derive(Clone, Debug)]
pub struct AutoOptions {
    /// Methods no candidate may use.
    pub excluded: Vec<String>,
    /// Methods every candidate must use.
    pub included: Vec<String>,
    /// A strategy to use instead of searching (semi-automatic mode).
    pub load_strategy: Option<StrategySource>,
    /// With `load_strategy`, skip the dry run that checks it.
    pub ignore_dryrun_on_load_strategy: bool,
    /// With `load_strategy`, tune its knobs (prefetch, bucket size) with short dry runs.
    pub finetune_strategy: bool,
    /// Where to save the chosen strategy, if anywhere.
    pub save_strategy_to_file: Option<PathBuf>,
    /// Logs each dry run's outcome (on rank 0).
    pub verbose: bool,
    /// Time for the search; when it is up the best candidate so far is taken.
    pub time_limit: Option<Duration>,
    /// Parameters that get no gradient in a step are expected (otherwise an error).
    pub find_unused_parameters: bool,
    /// How the search walks the candidates (default: guided).
    pub search: SearchMode,
    /// Timed steps per dry run (after one warm-up step).
    pub dry_run_steps: usize,
    /// Dry runs more of each finalist within 15% of the fastest, to settle a close call
    /// (0: one measurement decides).
    pub confirm_runs: usize,
    /// Low-rank adapters to train where full fine-tuning fits no candidate: the search then
    /// runs again over the same candidates with every parameter but the adapters frozen,
    /// and the strategy it finds gains this `lora` method.
    pub lora: Option<Box<LoraConfig>>,
}

impl Default for AutoOptions {
    fn default() -> Self {
        AutoOptions {
            excluded: vec![],
            included: vec![],
            load_strategy: None,
            ignore_dryrun_on_load_strategy: true,
            finetune_strategy: false,
            save_strategy_to_file: None,
            verbose: false,
            time_limit: None,
            find_unused_parameters: false,
            search: SearchMode::Guided,
            dry_run_steps: 3,
            confirm_runs: 2,
            lora: None,
        }
    }
}

/// One training job to accelerate.
pub struct AutoAccelerate<'a> {
    /// Adds the model's layers to a builder; called for every build of the model.
    pub model: &'a (dyn Fn(&mut Builder) -> Result<()> + Sync),
    /// Parameters left out of training (name substrings).
    pub freeze: Vec<String>,
    /// The optimizer and its hyperparameters.
    pub optim: OptimizerConfig,
    /// Parameter groups (`optim_param_func`).
    pub optim_param_func: Vec<GroupRule>,
    /// The training data.
    pub dataset: Arc<Dataset>,
    /// The loss; `None` (the default): next-token cross-entropy, vocabulary-parallel where
    /// the strategy splits the vocabulary.
    pub loss_func: Option<LossFn>,
    /// Turns a micro-batch into the model's input (default: its token ids).
    pub prepare_input: InputFn,
    /// Positions per row, rows per step and micro-batches per step.
    pub dataloader_args: Batching,
    /// Learning-rate schedule (default: constant).
    pub lr_scheduler: LrSchedule,
    /// Global gradient-norm clip (default: 1).
    pub grad_clip: Option<f64>,
    /// Device, seed and memory budget of each rank.
    pub engine: EngineConfig,
    /// The communicator across ranks (`None`: one process).
    pub comm: Option<&'a Comm>,
    /// Ranks on one node, the shard group of HYBRID_SHARD by default (1 unless set).
    pub local_world_size: usize,
    /// How the strategy is loaded or searched.
    pub options: AutoOptions,
    /// Decoding a run does beside its steps (GRPO's generation), which every dry run does
    /// once before its steps, so that its peak counts the key/value cache.
    pub generation: Option<bench::GenerationProbe>,
}

impl<'a> AutoAccelerate<'a> {
    /// A job with the defaults: next-token loss on token ids, constant schedule, clipping at 1.
    pub fn new(
        model: &'a (dyn Fn(&mut Builder) -> Result<()> + Sync),
        dataset: Arc<Dataset>,
        dataloader_args: Batching,
    ) -> AutoAccelerate<'a> {
        AutoAccelerate {
            model,
            freeze: vec![],
            optim: OptimizerConfig::default(),
            optim_param_func: vec![],
            dataset,
            loss_func: None,
            prepare_input: token_input(),
            dataloader_args,
            lr_scheduler: LrSchedule::Constant,
            grad_clip: Some(1.0),
            engine: EngineConfig::default(),
            comm: None,
            local_world_size: 1,
            options: AutoOptions::default(),
            generation: None,
        }
    }
}

/// How to drive the prepared run (ATorch's `args`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreparedArgs {
    /// Always false: `Trainer::train_step` runs backward itself.
    pub use_optim_backward: bool,
    /// Whether gradient accumulation is on; the trainer marks the boundary itself.
    pub requires_set_gradient_accumulation_boundary: bool,
}

/// The prepared run: trainer (engine, optimizer, loss, input preparation), data loader.
pub struct Prepared {
    /// Engine, optimizer, loss and input preparation under the chosen strategy.
    pub trainer: Trainer,
    /// This rank's data loader.
    pub loader: DataLoader,
    /// How to drive the run.
    pub args: PreparedArgs,
    /// Data-parallel buckets chosen (tuned with `finetune_strategy`).
    pub bucket_bytes: usize,
}

/// The outcome of `auto_accelerate`.
pub struct AutoResult {
    /// Whether a run was prepared.
    pub status: bool,
    /// Why it failed, when it did.
    pub reason: Option<String>,
    /// The prepared run, when there is one.
    pub result: Option<Prepared>,
    /// The strategy chosen, when one was.
    pub best_strategy: Option<Strategy>,
    /// How the strategy was chosen (empty on failure).
    pub report: SearchReport,
}

/// A strategy chosen for a job, with the report of how.
pub struct Choice {
    /// The strategy to run.
    pub strategy: Strategy,
    /// Data-parallel bucket size, bytes (tuned with `finetune_strategy`).
    pub bucket_bytes: usize,
    /// How it was chosen: the search's trials, or how it was loaded.
    pub report: SearchReport,
}

/// Prepares `job` with a loaded or searched strategy.
pub fn auto_accelerate(job: AutoAccelerate<'_>) -> AutoResult {
    let chosen = choose_strategy(&job);
    let outcome = chosen.and_then(|choice| {
        let prepared = prepare(&job, &choice.strategy, choice.bucket_bytes)?;
        Ok((prepared, choice))
    });
    match outcome {
        Ok((prepared, choice)) => AutoResult {
            status: true,
            reason: None,
            result: Some(prepared),
            best_strategy: Some(choice.strategy),
            report: choice.report,
        },
        Err(e) => AutoResult {
            status: false,
            reason: Some(e.to_string()),
            result: None,
            best_strategy: None,
            report: SearchReport::default(),
        },
    }
}

fn rank_and_world(comm: Option<&Comm>) -> (usize, usize) {
    comm.map_or((0, 1), |c| (c.rank(), c.size()))
}

/// The mesh `strategy` makes of the job's ranks.
fn mesh_of(job: &AutoAccelerate<'_>, strategy: &Strategy) -> Result<Mesh> {
    parallel::mesh_of(strategy, job.comm, job.local_world_size)
}

/// The loader of this rank on `mesh` (the ranks of a tensor group or a pipeline read the
/// same batches).
/// What this rank of `mesh` reads under `strategy`: its data replica's batches and, under
/// context parallelism, its piece of every row.
fn loader_config(job: &AutoAccelerate<'_>, mesh: &Mesh, strategy: &Strategy) -> LoaderConfig {
    let (rank, world) = mesh.batch_shard();
    LoaderConfig {
        rank,
        world,
        context: parallel::rows_piece(mesh, strategy),
        device: job.engine.device,
        ..LoaderConfig::new(job.dataloader_args.clone())
    }
}

fn placement<'a>(job: &AutoAccelerate<'a>, bucket_bytes: usize) -> RankLayout<'a> {
    RankLayout {
        comm: job.comm,
        local_world_size: job.local_world_size,
        data_parallel: DataParallelOptions { bucket_bytes, find_unused_parameters: job.options.find_unused_parameters },
        stage: false,
        optimizer_bytes_per_element: job.optim.state_bytes_per_element(),
        non_model: None,
        shard_floor: None,
    }
}

/// Builds the trainer (one engine, or this rank's pipeline stages, as a run builds them)
/// and loader for `strategy`.
pub fn prepare(job: &AutoAccelerate<'_>, strategy: &Strategy, bucket_bytes: usize) -> Result<Prepared> {
    let mesh = mesh_of(job, strategy)?;
    let bench = bench(job, bucket_bytes, 0, strategy.lora())?;
    let loader = || DataLoader::new(job.dataset.clone(), loader_config(job, &mesh, strategy));
    let first = loader()?.next().ok_or_else(|| Error::Data("the data holds no step to measure on".into()))??;
    // The prepared trainer reports the job's loss, as a run's does.
    let trainer = bench.trainer(strategy, &first, bench.world.clone())?;
    let args = PreparedArgs {
        use_optim_backward: false,
        requires_set_gradient_accumulation_boundary: job.dataloader_args.accumulation > 1,
    };
    Ok(Prepared { trainer, loader: loader()?, args, bucket_bytes })
}

/// What a dry run of `job` needs, with `steps` steps of real batches (training `lora`'s
/// adapters, where given).
fn bench<'a>(
    job: &'a AutoAccelerate<'a>,
    bucket_bytes: usize,
    steps: usize,
    lora: Option<&'a LoraConfig>,
) -> Result<Bench<'a>> {
    // Batches for every share of the batch (and piece of the rows) a tensor, pipeline,
    // context and expert group size dividing the world gives this rank, on the mesh the
    // candidates' strategies lay out: few steps each.
    let world_size = rank_and_world(job.comm).1;
    let expert_sizes = {
        let mut b = Builder::new();
        (job.model)(&mut b)?;
        b.build()?.expert_group_sizes(world_size)
    };
    let mut batches = std::collections::BTreeMap::new();
    for shape in candidate::batch_shapes(world_size, job.dataloader_args.ctx, &expert_sizes) {
        let strategy = shape.strategy(&[])?;
        let mesh = mesh_of(job, &strategy)?;
        let key = bench::batch_key(&mesh, &strategy);
        if batches.contains_key(&key) {
            continue;
        }
        // A batch that does not split over these replicas rules out their layouts alone.
        let config = loader_config(job, &mesh, &strategy);
        if let Err(Error::Config(why)) = config.micro_batch_rows() {
            batches.insert(key, Err(why));
            continue;
        }
        let steps_here = DataLoader::new(job.dataset.clone(), config)?.take(steps).collect::<Result<Vec<_>>>()?;
        if steps_here.len() < steps {
            return Err(Error::Data(format!("the data gives {} steps, a dry run needs {steps}", steps_here.len())));
        }
        batches.insert(key, Ok(steps_here));
    }
    // A dry run that fails on some pipeline stages leaves the others waiting for it until
    // their collectives time out: the agreement that follows waits three timeouts, so that
    // the rank that failed first is still there when the others arrive.
    let world: Option<Arc<dyn ProcessGroup>> = match job.comm.filter(|c| c.size() > 1) {
        Some(c) => Some(Arc::from(c.world_waiting(3 * c.timeout())?)),
        None => None,
    };
    Ok(Bench {
        model: job.model,
        freeze: &job.freeze,
        lora,
        chunk: None,
        engine: job.engine.clone(),
        optimizer: job.optim.clone(),
        rules: &job.optim_param_func,
        schedule: job.lr_scheduler.clone(),
        grad_clip: job.grad_clip,
        placement: placement(job, bucket_bytes),
        feed: Feed { input: job.prepare_input.clone(), loss: job.loss_func.clone() },
        steps: batches,
        world,
        started: std::time::Instant::now(),
        generation: job.generation.clone(),
    })
}

/// The strategy for `job`: loaded (checked by a dry run unless told not to, tuned with
/// `finetune_strategy`) or searched, pipeline sizes among the candidates. Saved to
/// `save_strategy_to_file` when asked.
pub fn choose_strategy(job: &AutoAccelerate<'_>) -> Result<Choice> {
    // Count every allocation from here on: dry runs measure activation memory.
    strata_ext::cpu_memory::track()?;
    let o = &job.options;
    let steps = o.dry_run_steps.max(1) + 1;
    let choice = match &o.load_strategy {
        Some(source) => {
            let strategy = source.load()?;
            if o.finetune_strategy {
                finetune(job, strategy, steps)?
            } else if !o.ignore_dryrun_on_load_strategy {
                let b = bench(job, DEFAULT_BUCKET_BYTES, steps, strategy.lora())?;
                let (speed, peak) = match b.trial(&strategy, job.engine.device_budget)? {
                    Outcome::Fits { tokens_per_s, peak_bytes, .. } => (tokens_per_s, peak_bytes),
                    Outcome::OverBudget { peak_bytes: Some(peak), .. } => {
                        return Err(Error::Config(format!(
                            "the loaded strategy peaks at {peak} bytes, over the budget"
                        )))
                    }
                    Outcome::OverBudget { peak_bytes: None, .. } => {
                        return Err(Error::Config("the loaded strategy runs out of memory".into()))
                    }
                    other => return Err(Error::Config(format!("the loaded strategy's dry run: {other:?}"))),
                };
                let report = SearchReport {
                    mode: format!("loaded, dry run: {speed:.0} tokens/s, peak {peak} bytes"),
                    ..Default::default()
                };
                Choice { strategy, bucket_bytes: DEFAULT_BUCKET_BYTES, report }
            } else {
                Choice {
                    strategy,
                    bucket_bytes: DEFAULT_BUCKET_BYTES,
                    report: SearchReport { mode: "loaded".into(), ..Default::default() },
                }
            }
        }
        None => search(job, steps)?,
    };
    if let Some(path) = &o.save_strategy_to_file {
        choice.strategy.save(path)?;
    }
    Ok(choice)
}

/// Searches with every parameter trained; where nothing fits, again with the loss computed
/// in chunks in the head (where the model's head can and the job scores with the
/// next-token loss), then with the rows split over context ranks (where there are several
/// ranks and the model's units take pieces of rows), then with the units' kept values
/// offloaded to the host as well; then,
/// where the options give adapters, training those alone, in the same passes. Each pass
/// that fits nothing says why in the final refusal.
fn search(job: &AutoAccelerate<'_>, steps: usize) -> Result<Choice> {
    let o = &job.options;
    for name in o.included.iter().chain(&o.excluded) {
        if !crate::strategy::METHODS.contains(&name.as_str()) {
            return Err(Error::Config(format!(
                "unknown method {name:?} in included/excluded; allowed: {}",
                crate::strategy::METHODS.join(", ")
            )));
        }
    }
    let has = |list: &[String], method: &str| list.iter().any(|m| m == method);
    let spec = || -> Result<crate::model::ModelSpec> {
        let mut b = Builder::new();
        (job.model)(&mut b)?;
        b.build()
    };
    // Chunks change something only where a micro-batch (at most the step's rows over its
    // micro-batches, on one rank) holds more positions than a chunk.
    let chunk = ChunkedLossConfig::default().positions;
    let a = &job.dataloader_args;
    let most_positions = (a.batch_size / a.accumulation.max(1) * a.ctx) as i64;
    let chunked = job.loss_func.is_none()
        && !has(&o.excluded, "chunked_loss")
        && most_positions > chunk
        && spec()?.scores_in_chunks();
    let shelving = !has(&o.excluded, "activation_offload");
    // Rows split over context ranks: where there are several ranks and the model's units
    // take pieces of rows.
    let world = rank_and_world(job.comm).1;
    let splitting = world > 1 && !has(&o.excluded, "context_parallel") && spec()?.check_context_parallel(None).is_ok();
    // (adapters, loss chunk, rows split, activation offload): the plain passes unless every
    // candidate must chunk its loss, split its rows or offload its activations.
    let mut passes: Vec<Pass<'_>> = vec![];
    for lora in std::iter::once(None).chain(o.lora.as_deref().map(Some)) {
        let must_shelve = has(&o.included, "activation_offload");
        let must_split = has(&o.included, "context_parallel");
        let chunk = (chunked || has(&o.included, "chunked_loss")).then_some(chunk);
        if !has(&o.included, "chunked_loss") && !must_shelve && !must_split {
            passes.push(Pass { lora, chunk: None, split: false, shelved: false });
        }
        if chunked && !must_shelve && !must_split {
            passes.push(Pass { lora, chunk, split: false, shelved: false });
        }
        if (splitting || must_split) && !must_shelve {
            passes.push(Pass { lora, chunk, split: true, shelved: false });
        }
        if shelving {
            passes.push(Pass { lora, chunk, split: must_split, shelved: true });
        }
    }
    let mut refusals: Vec<(Vec<String>, String)> = vec![];
    for pass in passes {
        match search_with(job, steps, &pass)? {
            Ok(mut choice) => {
                let mut why = vec![];
                if let Some(lora) = pass.lora {
                    choice.strategy.methods.push(Method::Lora(lora.clone()));
                    why.push("training LoRA adapters: full fine-tuning fits no candidate");
                }
                if pass.chunk.is_some() && !has(&o.included, "chunked_loss") {
                    why.push("the loss computed in chunks: the plain loss fits no candidate");
                }
                if pass.split && !has(&o.included, "context_parallel") {
                    why.push("rows split over context ranks: no candidate fits them whole");
                }
                if pass.shelved && !has(&o.included, "activation_offload") {
                    why.push("activations offloaded to the host: no candidate fits keeping them");
                }
                if !why.is_empty() {
                    choice.report.mode = format!("{}, {}", choice.report.mode, why.join(", "));
                    choice.report.chosen_strategy = Some(choice.strategy.to_value());
                }
                return Ok(choice);
            }
            Err(reason) => {
                let mut what = String::from(match pass.lora {
                    None => "training every parameter",
                    Some(_) => "training LoRA adapters",
                });
                let with: Vec<&str> = [
                    (pass.chunk.is_some(), "the loss in chunks"),
                    (pass.split, "rows split over context ranks"),
                    (pass.shelved, "activations offloaded"),
                ]
                .into_iter()
                .filter_map(|(on, name)| on.then_some(name))
                .collect();
                if !with.is_empty() {
                    what = format!("{what} with {}", with.join(" and "));
                }
                // Passes refused for one reason (the profile they share) say it once.
                match refusals.iter_mut().find(|(_, earlier)| *earlier == reason) {
                    Some((whats, _)) => whats.push(what),
                    None => refusals.push((vec![what], reason)),
                }
            }
        }
    }
    let refusals: Vec<String> =
        refusals.into_iter().map(|(whats, reason)| format!("{}: {reason}", whats.join(", nor "))).collect();
    Err(Error::Config(format!("auto_accelerate found no strategy, {}", refusals.join("\nnor "))))
}

/// One pass of the search: the adapters trained alone (where given), the head's loss chunk,
/// whether rows are split over context ranks and whether the units' kept values wait on
/// the host, set on every candidate.
struct Pass<'a> {
    lora: Option<&'a LoraConfig>,
    chunk: Option<i64>,
    split: bool,
    shelved: bool,
}

/// Each of `layouts` with its rows of `ctx` positions split over every context size above
/// one that divides the ranks its tensor and pipeline sizes leave, by each exchange `spec`
/// takes there.
fn split_rows(layouts: Vec<Layout>, spec: &crate::model::ModelSpec, ctx: i64, world: usize) -> Vec<Layout> {
    let mut out = vec![];
    for layout in layouts {
        let t = layout.candidate.tensor.max(1);
        let left = world / (t * layout.pipeline.max(1));
        for c in (2..=left).filter(|c| left.is_multiple_of(*c)) {
            for kind in candidate::context_kinds(spec, ctx, t, c) {
                out.push(layout.with_context(c, kind));
            }
        }
    }
    out
}

/// The best candidate for `job` (training `lora`'s adapters alone, where given), or why
/// there is none, with the search's table.
fn search_with(job: &AutoAccelerate<'_>, steps: usize, pass: &Pass<'_>) -> Result<std::result::Result<Choice, String>> {
    let (lora, chunk) = (pass.lora, pass.chunk);
    let o = &job.options;
    let mut b = bench(job, DEFAULT_BUCKET_BYTES, steps, lora)?;
    b.chunk = chunk;
    // The profiling pass holds one unit and one micro-batch's fp32 activations: where even
    // that exceeds the budget, no candidate can fit.
    let analysis = match bench::analyse(&b) {
        Ok(analysis) => analysis,
        Err(Error::OutOfMemory { placement, budget, .. }) => {
            return Ok(Err(format!(
                "profiling one micro-batch unit by unit in fp32 already needs more than the {placement} budget of \
                 {budget} bytes; give more memory or a smaller micro-batch"
            )))
        }
        Err(other) => return Err(other),
    };
    // Offload is worth trying only where a device budget can be short.
    let offload = job.engine.device_budget.is_some() || o.included.iter().any(|m| m == "offload");
    let sizes = candidate::Sizes {
        tensor: &analysis.tensor_sizes,
        pipeline: &analysis.pipeline_sizes,
        experts: &analysis.expert_sizes,
    };
    // The chunked loss, the rows' split and activation offload are set on the candidates
    // below, not among their methods yet.
    let set_below = ["chunked_loss", "context_parallel", "activation_offload"];
    let included: Vec<String> = o.included.iter().filter(|m| !set_below.contains(&m.as_str())).cloned().collect();
    let mut cands = candidate::candidates(&o.excluded, &included, !analysis.blocks.is_empty(), sizes, offload);
    if chunk.is_some() {
        cands.iter_mut().for_each(|l| l.candidate.chunked_loss = chunk);
    }
    if pass.split {
        cands = split_rows(cands, &b.spec()?, job.dataloader_args.ctx as i64, b.world_size());
    }
    cands.iter_mut().for_each(|l| l.candidate.activation_offload = pass.shelved);
    if cands.is_empty() {
        return Err(Error::Config("no candidate strategy uses every included method and none excluded".into()));
    }
    let limits = SearchLimits {
        device: job.engine.device,
        world: b.world_size(),
        budget: job.engine.device_budget,
        time_limit: o.time_limit,
        confirm_runs: o.confirm_runs,
    };
    let mut predictor = predictor(job, &b, &analysis)?;
    let mut measure = &b;
    let mut s = Search::new(&mut measure, analysis, cands, &mut |l| predictor.predict(l), limits)?;
    s.verbose = o.verbose && rank_and_world(job.comm).0 == 0;
    match o.search {
        SearchMode::Guided => s.guided()?,
        SearchMode::Exhaustive => s.exhaustive()?,
    }
    let Some(best) = s.best() else {
        let why = if s.trials.iter().all(|t| matches!(t.outcome, Outcome::Pruned { .. })) {
            "every candidate was pruned (see the report)".to_string()
        } else if s.stopped_by_time_limit {
            "the time limit ran out before any candidate was measured to fit".into()
        } else {
            "no candidate fits the memory budget".into()
        };
        return Ok(Err(format!("{why}\n{}", s.report(o.search, None)?.table())));
    };
    let report = s.report(o.search, Some(best))?;
    let strategy = s.cands[best].strategy(&s.analysis.blocks)?;
    Ok(Ok(Choice { strategy, bucket_bytes: DEFAULT_BUCKET_BYTES, report }))
}

/// The analytic models for `job` on this machine, fed by the profile: this machine's
/// throughput measured on every rank at once (as the dry runs share it) and agreed as the
/// ranks' mean, so that every rank predicts the same.
fn predictor(job: &AutoAccelerate<'_>, b: &Bench<'_>, analysis: &Analysis) -> Result<Predictor> {
    let spec = b.spec()?;
    let world = b.world_size();
    let a = &job.dataloader_args;
    let shape = JobShape {
        world,
        batch_size: a.batch_size,
        accumulation: a.accumulation.max(1),
        // Rows as long as the profiled ones (a run's rows may be padded short of its
        // context).
        ctx: (analysis.profiled_tokens / analysis.profiled_rows.max(1)).max(1) as i64,
        optimizer_state_bytes: job.optim.state_bytes_per_element(),
    };
    let device = match job.engine.device {
        tch::Device::Cuda(i) => calibrate::cuda_kind(i)?,
        _ => {
            let tokens = analysis.profiled_tokens.max(1) as i64;
            let width = spec.params.iter().map(|p| p.shape.last().copied().unwrap_or(1)).max().unwrap_or(1);
            let mut cpu = calibrate::this_machine(tokens, width.min(4096))?;
            let local = [cpu.fp32_flops, cpu.bf16_flops, cpu.memory_bandwidth, cpu.op_seconds];
            let agreed = match &b.world {
                Some(g) => crate::comm::all_reduce_values(g.as_ref(), &local, crate::comm::ReduceOp::Avg)?,
                None => local.to_vec(),
            };
            (cpu.fp32_flops, cpu.bf16_flops, cpu.memory_bandwidth, cpu.op_seconds) =
                (agreed[0], agreed[1], agreed[2], agreed[3]);
            cpu
        }
    };
    Predictor::new(spec, analysis, shape, calibrate::node_of(device, world))
}

/// One change of a sharding method's configuration.
type KnobChange = fn(&mut crate::strategy::ShardConfig);

/// Tunes the loaded strategy's knobs one at a time with dry runs: the sharding method's
/// prefetching (`forward_prefetch`, `backward_prefetch`, `limit_all_gathers`), or the data
/// parallel bucket size.
fn finetune(job: &AutoAccelerate<'_>, strategy: Strategy, steps: usize) -> Result<Choice> {
    let sharding = strategy.sharding().map(|(name, _)| name);
    let buckets = sharding.is_none() && rank_and_world(job.comm).1 > 1;
    if sharding != Some(ShardMethod::Fsdp) && !buckets {
        let what = sharding.map_or("data parallel on one rank".to_string(), |name| format!("{name} (no buckets)"));
        return Err(Error::Config(format!(
            "finetune_strategy: {what} has nothing to tune; it tunes fsdp's prefetching and data parallel's buckets"
        )));
    }
    let mut trials = Vec::new();
    // One set of batches for every variant; only the bucket size changes between them.
    let mut b = bench(job, DEFAULT_BUCKET_BYTES, steps, strategy.lora())?;
    let mut measure = |s: &Strategy, bucket: usize, label: String| -> Result<Option<f64>> {
        b.placement.data_parallel.bucket_bytes = bucket;
        let outcome = b.trial(s, job.engine.device_budget)?;
        let speed = match outcome {
            Outcome::Fits { tokens_per_s, .. } => Some(tokens_per_s),
            _ => None,
        };
        let strategy = Some(s.to_value());
        trials.push(search::Trial { label, candidate: None, strategy, predicted: None, outcome });
        Ok(speed)
    };
    let mut best = (strategy.clone(), DEFAULT_BUCKET_BYTES);
    let Some(mut best_speed) = measure(&strategy, DEFAULT_BUCKET_BYTES, "as loaded".into())? else {
        return Err(Error::Config("the loaded strategy does not run within the budget: nothing to fine-tune".into()));
    };
    // Prefetching exists only where parameters are gathered (fsdp).
    let variants: Vec<(Strategy, usize, String)> =
        if strategy.sharding().is_some_and(|(method, _)| method == ShardMethod::Fsdp) {
            let knobs: [(&str, KnobChange); 4] = [
                ("forward_prefetch switched", |c| c.forward_prefetch = !c.forward_prefetch),
                ("backward_prefetch switched", |c| {
                    c.backward_prefetch = match c.backward_prefetch {
                        Some(BackwardPrefetch::Pre) => Some(BackwardPrefetch::Post),
                        _ => Some(BackwardPrefetch::Pre),
                    }
                }),
                ("limit_all_gathers switched", |c| c.limit_all_gathers = !c.limit_all_gathers),
                ("overlap_comm switched", |c| c.overlap_comm = !c.overlap_comm),
            ];
            knobs
                .iter()
                .map(|(label, change)| {
                    let mut s = best.0.clone();
                    for m in &mut s.methods {
                        if let Method::Zero1(c) | Method::Zero2(c) | Method::Fsdp(c) = m {
                            change(c);
                        }
                    }
                    (s, DEFAULT_BUCKET_BYTES, label.to_string())
                })
                .collect()
        } else {
            [DEFAULT_BUCKET_BYTES / 6, DEFAULT_BUCKET_BYTES * 4]
                .iter()
                .map(|&b| (strategy.clone(), b, format!("bucket {} MiB", b >> 20)))
                .collect()
        };
    for (s, bucket, label) in variants {
        if let Some(speed) = measure(&s, bucket, label)? {
            if speed > best_speed {
                best_speed = speed;
                best = (s, bucket);
            }
        }
    }
    let report = SearchReport { mode: "finetune".into(), dry_runs: trials.len(), trials, ..Default::default() };
    Ok(Choice { strategy: best.0, bucket_bytes: best.1, report })
}
