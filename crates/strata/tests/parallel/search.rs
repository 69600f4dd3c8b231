//! The strategy search's logic against deterministic cost tables: the choice, the dry-run
//! count, the time limit, the memory rules and agreement across ranks. Nothing here is timed:
//! a table gives each candidate's speed, peak and seconds, and the clock is the sum of the
//! seconds of the dry runs so far. Real measurements belong to `strata bench search`.
use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use strata::auto::calibrate;
use strata::auto::candidate::{candidates, capability, Candidate, Layout, Precision, Sharding, Sizes};
use strata::auto::cost::{Analysis, JobShape, Predictor};
use strata::auto::estimate;
use strata::auto::search::{agree_outcome, Measure, Outcome, Search, SearchLimits, SearchMode, SearchReport};
use strata::comm::ProcessGroup;
use strata::model::{GptConfig, LlamaConfig, ModelConfig, ModelSpec, MoeConfig};
use strata::strategy::Strategy;
use strata::Error;
use tch::Device;

/// What a candidate's dry run gives in a table.
#[derive(Clone, Copy, Debug)]
enum Cost {
    Runs { tokens_per_s: f64, peak_bytes: u64 },
    OutOfMemory,
}

/// A measurement from a cost function: every dry run takes `seconds`.
struct Table<'a> {
    cost: &'a dyn Fn(&Layout) -> Cost,
    seconds: f64,
    clock: f64,
    /// Labels of the candidates dry-run, in order, re-measurements included.
    runs: Vec<String>,
    group: Option<Arc<dyn ProcessGroup>>,
    /// The run (by index) at which this rank fails on its own.
    fail_at: Option<usize>,
}

impl<'a> Table<'a> {
    fn new(cost: &'a dyn Fn(&Layout) -> Cost) -> Table<'a> {
        Table { cost, seconds: 10.0, clock: 0.0, runs: vec![], group: None, fail_at: None }
    }
}

impl Measure for Table<'_> {
    fn trial(&mut self, candidate: &Layout, _: &Strategy, budget: Option<u64>) -> strata::Result<Outcome> {
        let local = if self.fail_at == Some(self.runs.len()) {
            Err(Error::Engine("injected failure".into()))
        } else {
            match (self.cost)(candidate) {
                Cost::Runs { tokens_per_s, peak_bytes } => Ok((tokens_per_s, peak_bytes)),
                Cost::OutOfMemory => Err(Error::OutOfMemory {
                    placement: "device".into(),
                    requested: 1,
                    in_use: 0,
                    budget: budget.unwrap_or(0),
                }),
            }
        };
        self.runs.push(candidate.label());
        self.clock += self.seconds;
        agree_outcome(self.group.as_deref(), &local, self.seconds, budget)
    }

    fn elapsed(&mut self) -> strata::Result<f64> {
        Ok(self.clock)
    }
}

/// A GPT of eight blocks (ten units, 6.4M parameters): what the predictions are about.
fn model() -> ModelConfig {
    ModelConfig::Gpt(GptConfig::new(256, 32, 8, 4, 256))
}

fn spec() -> ModelSpec {
    model().spec().unwrap()
}

/// Its profile as the search would take it, for a micro-batch of 4 rows of 32 tokens: each
/// unit keeps what its layers save (in fp32, attention unfused) and outputs a width per
/// token.
fn analysis() -> Analysis {
    analysis_of(&spec())
}

/// [`analysis`] of another model, with the expert group sizes its experts split over at 4
/// ranks.
fn analysis_of(spec: &ModelSpec) -> Analysis {
    let tokens = 128.0;
    let kept = estimate::counted(spec).unwrap();
    Analysis {
        params: spec.num_params(),
        trainable_params: spec.num_params(),
        unit_params: spec.units.iter().map(|u| u.params.iter().map(|id| spec.params[id.0].numel()).sum()).collect(),
        unit_activation_bytes: kept.iter().map(|k| (4.0 * tokens * (k.values + 32.0 * k.scores)) as u64).collect(),
        unit_output_bytes: kept.iter().map(|k| (4.0 * tokens * k.output) as u64).collect(),
        profiled_rows: 4,
        profiled_tokens: tokens as u64,
        step_seconds: 0.1,
        ledger_peak_bytes: 0,
        allocator_peak_bytes: 0,
        blocks: spec.block_kinds(),
        tensor_sizes: vec![],
        pipeline_sizes: vec![],
        expert_sizes: spec.expert_group_sizes(4),
    }
}

/// The analytic models over `analysis()` at `world` ranks, 4 rows per rank per step, on a
/// machine of fixed figures (nothing measured).
fn predictor(world: usize) -> Predictor {
    predictor_of(spec(), &analysis(), world)
}

/// [`predictor`] of another model and its profile.
fn predictor_of(spec: ModelSpec, analysis: &Analysis, world: usize) -> Predictor {
    let mut cpu = estimate::device_kind("cpu").unwrap();
    (cpu.fp32_flops, cpu.bf16_flops, cpu.memory_bandwidth, cpu.op_seconds) = (1e11, 5e10, 1e10, 1e-6);
    let job = JobShape { world, batch_size: 4 * world, accumulation: 1, ctx: 32, optimizer_state_bytes: 8 };
    Predictor::new(spec, analysis, job, calibrate::node_of(cpu, world)).unwrap()
}

/// The predicted peak of `layout` at `world` ranks.
fn peak(layout: &Layout, world: usize) -> u64 {
    predictor(world).predict(layout).unwrap().peak_bytes
}

fn plain(precision: Precision, sharding: Sharding, checkpoint: bool) -> Layout {
    Layout::new(Candidate::plain(precision, sharding, checkpoint))
}

#[test]
fn the_memory_estimate_orders_the_methods_as_zero_does() {
    let at = |precision, sharding, checkpoint| peak(&plain(precision, sharding, checkpoint), 4);
    let fp32 = Precision::Fp32;
    assert!(at(fp32, Sharding::None, false) > at(fp32, Sharding::Zero1, false));
    assert!(at(fp32, Sharding::Zero1, false) > at(fp32, Sharding::Zero2, false));
    assert!(at(fp32, Sharding::Zero2, false) > at(fp32, Sharding::Fsdp, false));
    assert!(at(fp32, Sharding::None, true) < at(fp32, Sharding::None, false), "recomputation keeps less");
    assert!(at(Precision::HalfBf16, Sharding::None, false) < at(Precision::AmpBf16, Sharding::None, false));
    let staged = |p| peak(&Layout::piped(plain(fp32, Sharding::None, false).candidate, p), 4);
    assert!(staged(4) < staged(2) && staged(2) < at(fp32, Sharding::None, false), "stages hold their units");
}

fn limits(world: usize, budget: Option<u64>, time_limit: Option<f64>) -> SearchLimits {
    let time_limit = time_limit.map(Duration::from_secs_f64);
    SearchLimits { device: Device::Cpu, world, budget, time_limit, confirm_runs: 2 }
}

/// Runs the search; its report and the labels dry-run in order.
fn run(table: &mut Table<'_>, limits: SearchLimits, mode: SearchMode) -> SearchReport {
    run_on(table, analysis(), limits, mode)
}

fn run_on(table: &mut Table<'_>, analysis: Analysis, limits: SearchLimits, mode: SearchMode) -> SearchReport {
    let sizes =
        Sizes { tensor: &analysis.tensor_sizes, pipeline: &analysis.pipeline_sizes, experts: &analysis.expert_sizes };
    let cands = candidates(&[], &[], true, sizes, false);
    let mut predictor = predictor(limits.world);
    let mut search = Search::new(table, analysis, cands, &mut |l| predictor.predict(l), limits).unwrap();
    match mode {
        SearchMode::Guided => search.guided().unwrap(),
        SearchMode::Exhaustive => search.exhaustive().unwrap(),
    }
    let best = search.best();
    search.report(mode, best).unwrap()
}

fn speed_of(report: &SearchReport, label: &str) -> Option<f64> {
    report.trials.iter().find(|t| t.label == label).and_then(|t| match t.outcome {
        Outcome::Fits { tokens_per_s, .. } => Some(tokens_per_s),
        _ => None,
    })
}

const NO_SIZES: Sizes<'static> = Sizes { tensor: &[], pipeline: &[], experts: &[] };

/// Runs on a CPU (fp16 and fp8 do not).
fn on_cpu(l: &Layout) -> bool {
    [Precision::Fp32, Precision::AmpBf16, Precision::HalfBf16].contains(&l.candidate.precision)
}

/// The candidates that can run on a CPU at two ranks.
fn runnable() -> Vec<Layout> {
    candidates(&[], &[], true, NO_SIZES, false).into_iter().filter(on_cpu).collect()
}

/// The best label of `table` over `cands` among those that fit `budget`.
fn table_best(cost: &dyn Fn(&Layout) -> Cost, cands: &[Layout], budget: Option<u64>) -> String {
    let fits = |c: &&Layout| match cost(c) {
        Cost::Runs { peak_bytes, .. } => budget.is_none_or(|b| peak_bytes <= b),
        Cost::OutOfMemory => false,
    };
    let speed = |c: &Layout| match cost(c) {
        Cost::Runs { tokens_per_s, .. } => tokens_per_s,
        Cost::OutOfMemory => 0.0,
    };
    cands.iter().filter(fits).max_by(|a, b| speed(a).total_cmp(&speed(b))).unwrap().label()
}

/// Speed as a product of one factor per dimension, plus an interaction: `half bf16` is slow
/// without sharding and the fastest of all with zero2 (its gradients are half the bytes).
fn trap_speed(c: &Candidate) -> f64 {
    let precision = match c.precision {
        Precision::Fp32 => 100.0,
        Precision::AmpBf16 => 110.0,
        _ => 90.0,
    };
    let sharding = match (c.precision, c.sharding) {
        (Precision::HalfBf16, Sharding::Zero2) => 1.4,
        (Precision::HalfBf16, _) => 1.0,
        (_, Sharding::None) => 1.0,
        (_, Sharding::Zero1) => 0.97,
        (_, Sharding::Zero2) => 0.95,
        (_, Sharding::Fsdp) => 0.9,
    };
    let replace = if c.module_replace { 1.05 } else { 1.0 };
    let recompute = if c.checkpoint { 0.8 } else { 1.0 };
    precision * sharding * replace * recompute
}

fn trap(l: &Layout) -> Cost {
    Cost::Runs { tokens_per_s: trap_speed(&l.candidate), peak_bytes: 1 }
}

/// What a plain one-dimension-at-a-time search picks: from the cheapest candidate, each
/// dimension in turn set to its best value with the others held, until nothing changes.
fn coordinate_search(cands: &[Candidate], speed: &dyn Fn(&Candidate) -> f64) -> Candidate {
    let mut current = cands
        .iter()
        .copied()
        .find(|c| c.precision == Precision::Fp32 && !c.module_replace && c.sharding == Sharding::None && !c.checkpoint)
        .unwrap();
    loop {
        let before = current;
        type Same = fn(&Candidate, &Candidate) -> bool;
        let dimensions: [Same; 4] = [
            |a, b| a.module_replace == b.module_replace && a.sharding == b.sharding && a.checkpoint == b.checkpoint,
            |a, b| a.precision == b.precision && a.sharding == b.sharding && a.checkpoint == b.checkpoint,
            |a, b| a.precision == b.precision && a.module_replace == b.module_replace && a.checkpoint == b.checkpoint,
            |a, b| a.precision == b.precision && a.module_replace == b.module_replace && a.sharding == b.sharding,
        ];
        for same in dimensions {
            current = cands
                .iter()
                .copied()
                .filter(|c| same(c, &current))
                .max_by(|a, b| speed(a).total_cmp(&speed(b)))
                .unwrap();
        }
        if current == before {
            return current;
        }
    }
}

#[test]
fn a_table_that_traps_a_one_dimension_search_does_not_trap_the_guided_one() {
    let cands = runnable();
    let methods: Vec<Candidate> = cands.iter().map(|l| l.candidate).collect();
    let naive = coordinate_search(&methods, &trap_speed);
    let best = table_best(&trap, &cands, None);
    assert_eq!(naive.label(), "amp bf16 + module_replace + data parallel", "the table is a trap");
    assert_eq!(best, "half bf16 + module_replace + zero2");
    let mut table = Table::new(&trap);
    let report = run(&mut table, limits(2, None, None), SearchMode::Guided);
    assert_eq!(report.chosen.as_deref(), Some(best.as_str()));
    assert_eq!(report.dry_runs, table.runs.len(), "every dry run counts");
    // A third of the candidates explored, then the close finalists twice more each.
    let explored: std::collections::BTreeSet<&String> = table.runs.iter().collect();
    assert!(explored.len() <= cands.len() / 3, "{} of {} candidates", explored.len(), cands.len());
    assert!(table.runs.len() <= explored.len() + 6);
    // A table gives the same figure every time: the mean of the re-measurements is it.
    assert_eq!(speed_of(&report, &best), Some(trap_speed(&candidate(&best))));
}

fn candidate(label: &str) -> Candidate {
    candidates(&[], &[], true, NO_SIZES, false).into_iter().find(|c| c.label() == label).unwrap().candidate
}

#[test]
fn the_exhaustive_search_runs_every_runnable_candidate_once_and_agrees_with_the_table() {
    let cands = runnable();
    let mut table = Table::new(&trap);
    let report = run(&mut table, limits(2, None, None), SearchMode::Exhaustive);
    assert_eq!(table.runs.len(), cands.len());
    assert_eq!(report.dry_runs, cands.len());
    assert_eq!(report.chosen, Some(table_best(&trap, &cands, None)));
    let pruned = report.trials.iter().filter(|t| matches!(t.outcome, Outcome::Pruned { .. })).count();
    assert_eq!(pruned + cands.len(), report.trials.len());
}

/// Peaks from the memory estimate, measured 10% above it, or out of memory where it
/// predicts more than `oom_above`; speed falls with the machinery used.
fn memory_table(world: usize, oom_above: u64) -> impl Fn(&Layout) -> Cost {
    move |l: &Layout| {
        let predicted = peak(l, world);
        if predicted > oom_above {
            return Cost::OutOfMemory;
        }
        let sharding = [1.0, 0.96, 0.93, 0.85][l.candidate.sharding as usize];
        let speed = trap_speed(&Candidate { sharding: Sharding::None, ..l.candidate }) * sharding;
        Cost::Runs { tokens_per_s: speed, peak_bytes: predicted + predicted / 10 }
    }
}

#[test]
fn over_the_budget_is_never_chosen_and_the_fastest_that_fits_is() {
    let world = 2;
    let at = |precision, sharding, checkpoint| peak(&plain(precision, sharding, checkpoint), world);
    // Between zero2's and zero1's fp32 peaks: data parallel and zero1 without recomputation
    // do not fit, and the cheapest starting points are over the budget when measured.
    let budget = (at(Precision::Fp32, Sharding::Zero2, false) + at(Precision::Fp32, Sharding::Zero1, false)) / 2;
    let oom_above = budget * 3 / 2;
    let cost = memory_table(world, oom_above);
    let cands = runnable();
    let mut table = Table::new(&cost);
    let report = run(&mut table, limits(world, Some(budget), None), SearchMode::Guided);
    let chosen = report.chosen.clone().expect("a candidate fits");
    assert_eq!(chosen, table_best(&cost, &cands, Some(budget)));
    let trial = |label: &str| report.trials.iter().find(|t| t.label == label).unwrap();
    match trial(&chosen).outcome {
        Outcome::Fits { peak_bytes, .. } => assert!(peak_bytes <= budget),
        ref other => panic!("chosen {chosen}: {other:?}"),
    }
    assert_eq!(report.dry_runs, table.runs.len());
    for t in &report.trials {
        match &t.outcome {
            // Pruned unmeasured only when the model puts it clearly (25%) over the budget.
            Outcome::Pruned { reason } if reason.contains("memory estimate") => {
                assert!(t.predicted_peak_bytes() as f64 > 1.25 * budget as f64, "{}", t.label)
            }
            Outcome::OverBudget { peak_bytes: Some(peak), .. } => assert!(*peak > budget, "{}", t.label),
            Outcome::OverBudget { peak_bytes: None, .. } => {
                assert!(t.predicted_peak_bytes() > oom_above, "{} ran out of memory", t.label)
            }
            Outcome::Fits { peak_bytes, .. } => assert!(*peak_bytes <= budget, "{}", t.label),
            _ => {}
        }
    }
    assert!(
        report.trials.iter().any(|t| matches!(t.outcome, Outcome::OverBudget { .. })),
        "the table puts some predicted fits over the budget; the search met one"
    );
    // Every measured peak is set beside the prediction (the table measures 10% above it).
    let text = report.table();
    let measured = text.lines().filter(|l| l.contains("peak")).count();
    assert!(measured > 0 && text.matches("peak 0.0 MiB").count() == 0, "{text}");
    assert_eq!(text.matches("(1.10× predicted)").count(), measured, "{text}");
}

#[test]
fn the_time_limit_is_checked_before_every_dry_run_re_measurements_included() {
    let cands = runnable();
    // Each dry run takes 10 s: the limit of 35 s allows the runs starting at 0, 10, 20, 30.
    let mut table = Table::new(&trap);
    let report = run(&mut table, limits(2, None, Some(35.0)), SearchMode::Guided);
    assert!(report.stopped_by_time_limit);
    assert_eq!(report.dry_runs, 4);
    assert_eq!(table.runs.len(), 4);
    assert_eq!(report.seconds, 40.0);
    assert!(report.chosen.is_some());
    // A limit that falls among the finalists' re-measurements: found by running without a
    // limit first, then giving the time of all but two of its runs and a half.
    let mut free = Table::new(&trap);
    run(&mut free, limits(2, None, None), SearchMode::Guided);
    let explored = free.runs.iter().collect::<std::collections::BTreeSet<_>>().len();
    assert!(free.runs.len() > explored + 2, "the free search re-measures finalists: {:?}", free.runs);
    let limit = (free.runs.len() as f64 - 2.5) * 10.0;
    let mut limited = Table::new(&trap);
    let report = run(&mut limited, limits(2, None, Some(limit)), SearchMode::Guided);
    assert!(report.stopped_by_time_limit);
    assert_eq!(limited.runs.len(), free.runs.len() - 2, "stopped within one dry run of the limit");
    assert!(report.seconds < limit + 10.0);
    assert_eq!(report.dry_runs, limited.runs.len());
    assert!(cands.len() > limited.runs.len());
}

/// Two ranks (threads with a TCP mesh of their own) search the same table; rank 1 fails on
/// its own at its `fail_at`-th dry run.
fn two_ranks(fail_at: usize) -> Vec<(SearchReport, Vec<String>)> {
    common::ranks::threads(2, Duration::from_secs(30), move |rank, comm| {
        let mut table = Table::new(&trap);
        table.group = Some(Arc::from(comm.world().unwrap()));
        table.fail_at = (rank == 1).then_some(fail_at);
        let report = run(&mut table, limits(2, None, None), SearchMode::Guided);
        (report, table.runs)
    })
}

#[test]
fn a_failure_on_one_rank_is_agreed_and_every_rank_chooses_the_same() {
    let cands = runnable();
    let mut alone = Table::new(&trap);
    let reference = run(&mut alone, limits(2, None, None), SearchMode::Guided);
    let best = table_best(&trap, &cands, None);
    // Fail at the dry run of the best candidate itself: the ranks must agree it failed.
    let fail_at = alone.runs.iter().position(|l| *l == best).unwrap();
    let ranks = two_ranks(fail_at);
    let (r0, runs0) = &ranks[0];
    let (r1, runs1) = &ranks[1];
    assert_eq!(runs0, runs1, "both ranks dry-run the same candidates in the same order");
    assert_eq!(r0.chosen, r1.chosen);
    assert_ne!(r0.chosen.as_deref(), Some(best.as_str()), "a candidate that failed on any rank is out");
    let outcome = |r: &SearchReport| r.trials.iter().find(|t| t.label == best).unwrap().outcome.clone();
    match (outcome(r0), outcome(r1)) {
        (Outcome::Failed { reason: a, .. }, Outcome::Failed { reason: b, .. }) => {
            assert_eq!(a, "failed on another rank");
            assert!(b.contains("injected failure"), "{b}");
        }
        other => panic!("{other:?}"),
    }
    let by_label = |r: &SearchReport| -> BTreeMap<String, String> {
        r.trials.iter().map(|t| (t.label.clone(), format!("{:?}", std::mem::discriminant(&t.outcome)))).collect()
    };
    assert_eq!(by_label(r0), by_label(r1));
    assert_ne!(reference.chosen, r0.chosen);
}

/// Tensor sizes are a dimension like the others: split units hold a fraction of the model
/// states (the memory estimate says so), and where a tensor size is fastest the guided
/// search finds it, spending no more than its share of dry runs.
#[test]
fn the_search_tries_tensor_sizes_and_takes_one_where_it_is_best() {
    let world = 4;
    let a = Analysis { tensor_sizes: vec![2, 4], ..analysis() };
    let at = |tensor, sharding| {
        peak(&Layout::new(Candidate { tensor, ..plain(Precision::Fp32, sharding, false).candidate }), world)
    };
    assert!(at(2, Sharding::None) < at(1, Sharding::None), "a tensor rank holds its pieces only");
    assert!(at(4, Sharding::None) < at(2, Sharding::None));
    assert!(at(2, Sharding::Zero2) < at(2, Sharding::None), "sharding spans the ranks with the same pieces");
    assert!(at(2, Sharding::Fsdp) < at(1, Sharding::Fsdp), "split and sharded holds least");
    // On this table tensor size 2 is the fastest layout, 4 the slowest.
    let cost = |l: &Layout| {
        let speed = trap_speed(&l.candidate) * [1.0, 1.0, 1.3, 0.0, 0.7][l.candidate.tensor];
        Cost::Runs { tokens_per_s: speed, peak_bytes: peak(l, world) }
    };
    let mut table = Table::new(&cost);
    let report = run_on(&mut table, a.clone(), limits(world, None, None), SearchMode::Guided);
    let cands: Vec<Layout> = candidates(&[], &[], true, Sizes { tensor: &a.tensor_sizes, ..NO_SIZES }, false)
        .into_iter()
        .filter(|l| on_cpu(l) && !(l.candidate.tensor == 4 && l.candidate.sharding != Sharding::None))
        .collect();
    let best = table_best(&cost, &cands, None);
    assert!(best.contains("tensor 2"), "{best}");
    assert_eq!(report.chosen, Some(best));
    let explored: std::collections::BTreeSet<&String> = table.runs.iter().collect();
    assert!(explored.len() <= cands.len() / 3, "{} of {} candidates", explored.len(), cands.len());
}

/// Pipeline sizes are a dimension too. Under a budget only stages fit (each holds its
/// own units' states, where fsdp and zero keep whole units besides their shards): the
/// estimate prunes the rest before any dry run, and the guided search takes the fastest
/// pipeline that fits with at most a fifth of the exhaustive search's dry runs.
#[test]
fn where_only_a_pipeline_fits_the_search_finds_the_best_one_with_a_fifth_of_the_dry_runs() {
    let world = 4;
    let a = Analysis { pipeline_sizes: vec![2, 4], ..analysis() };
    let all: Vec<Layout> = candidates(&[], &[], true, Sizes { pipeline: &a.pipeline_sizes, ..NO_SIZES }, false)
        .into_iter()
        .filter(|l| on_cpu(l) && capability(l, Device::Cpu, world).is_none())
        .collect();
    // Just below the least any layout without stages needs.
    let budget = all.iter().filter(|l| l.pipeline == 1).map(|l| peak(l, world)).min().unwrap() - 1;
    // Stages cost their bubble; peaks as predicted.
    let cost = |l: &Layout| {
        let speed = trap_speed(&l.candidate) * [1.0, 1.0, 0.8, 0.0, 0.7][l.pipeline];
        Cost::Runs { tokens_per_s: speed, peak_bytes: peak(l, world) }
    };
    let mut exhaustive = Table::new(&cost);
    let everything = run_on(&mut exhaustive, a.clone(), limits(world, Some(budget), None), SearchMode::Exhaustive);
    let mut guided = Table::new(&cost);
    let report = run_on(&mut guided, a, limits(world, Some(budget), None), SearchMode::Guided);
    let best = table_best(&cost, &all, Some(budget));
    assert!(best.contains("pipeline"), "{best}");
    assert_eq!(everything.chosen.as_deref(), Some(best.as_str()));
    assert_eq!(report.chosen.as_deref(), Some(best.as_str()));
    assert!(
        5 * guided.runs.len() <= exhaustive.runs.len(),
        "{} dry runs against {}: {:?}",
        guided.runs.len(),
        exhaustive.runs.len(),
        guided.runs
    );
    let pruned = report
        .trials
        .iter()
        .filter(|t| matches!(&t.outcome, Outcome::Pruned { reason } if reason.contains("memory estimate")));
    assert!(pruned.count() > all.len() / 2, "the estimate rules most layouts out unmeasured");
}

/// One rank under a budget: offload is tried only where nothing else fits, and chosen then.
#[test]
fn offload_is_chosen_where_nothing_without_it_fits_and_only_there() {
    let at = |offload, checkpoint| {
        let c = Candidate { offload, ..plain(Precision::HalfBf16, Sharding::None, checkpoint).candidate };
        peak(&Layout::new(c), 1)
    };
    // Offloading costs a third of the speed; peaks as the memory estimate predicts them.
    let cost = |l: &Layout| {
        let c = &l.candidate;
        let speed = trap_speed(&Candidate { offload: false, ..*c }) * if c.offload { 0.66 } else { 1.0 };
        Cost::Runs { tokens_per_s: speed, peak_bytes: peak(l, 1) }
    };
    let search = |budget: u64| {
        let mut table = Table::new(&cost);
        let cands = candidates(&[], &[], true, NO_SIZES, true);
        let mut predictor = predictor(1);
        let limits = limits(1, Some(budget), None);
        let mut search = Search::new(&mut table, analysis(), cands, &mut |l| predictor.predict(l), limits).unwrap();
        search.guided().unwrap();
        let best = search.best();
        search.report(SearchMode::Guided, best).unwrap().chosen.expect("a candidate fits")
    };
    let tight = search(at(true, false) * 11 / 10);
    assert!(tight.contains("offload"), "nothing else fits: {tight}");
    assert!(at(false, true) < at(false, false), "the memory estimate sees recomputation");
    let roomy = search(at(false, false) * 2);
    assert!(!roomy.contains("offload"), "everything fits: {roomy}");
}

/// The speeds of a table where plain fsdp (fp32, nothing else) is the fastest of all, and
/// every neighbour the guided passes visit is slower than their own leaders: module
/// replacement speeds up every layout but fsdp's, so the fp32 leader the sharding pass starts
/// from has replaced modules, and its fsdp (with them) is slow.
fn hidden_baseline_speed(c: &Candidate) -> f64 {
    let plain = !c.module_replace && !c.checkpoint && c.tensor == 1 && !c.offload;
    if plain && c.precision == Precision::Fp32 && c.sharding == Sharding::Fsdp {
        return 200.0;
    }
    let precision = if c.precision == Precision::AmpBf16 { 110.0 } else { 100.0 };
    let sharding = if c.sharding == Sharding::None { 1.0 } else { 0.9 };
    let replace = match (c.module_replace, c.sharding) {
        (true, Sharding::Fsdp) => 0.5,
        (true, _) => 1.1,
        (false, _) => 1.0,
    };
    let recompute = if c.checkpoint { 0.8 } else { 1.0 };
    precision * sharding * replace * recompute
}

fn hidden_baseline(l: &Layout) -> Cost {
    Cost::Runs { tokens_per_s: hidden_baseline_speed(&l.candidate), peak_bytes: 1 }
}

/// Plain data parallel and plain fsdp are dry-run whatever the passes visit, so the choice
/// is never slower than either: here plain fsdp, which no pass reaches.
#[test]
fn plain_data_parallel_and_fsdp_are_always_measured_and_never_beaten_by_the_choice() {
    let mut table = Table::new(&hidden_baseline);
    let report = run(&mut table, limits(2, None, None), SearchMode::Guided);
    let (ddp, fsdp) = ("fp32 + data parallel", "fp32 + fsdp");
    for baseline in [ddp, fsdp] {
        assert!(table.runs.iter().any(|r| r == baseline), "{baseline} dry-run: {:?}", table.runs);
    }
    assert_eq!(report.chosen.as_deref(), Some(fsdp));
    let chosen = speed_of(&report, fsdp).unwrap();
    assert!(chosen >= speed_of(&report, ddp).unwrap());
}

/// A mixture of experts on four ranks (two LLaMA blocks of 8 experts, most of its weights):
/// the estimate sees that an expert group stores a share of the experts each, so that
/// below what any layout without expert groups needs, the layouts with them (fsdp over the
/// ranks outside a group gathers only its share of a layer) still fit; the guided search
/// takes the fastest of them with a third of the candidates' dry runs, and never pairs a
/// group with more ranks than the data ranks hold.
#[test]
fn where_only_expert_groups_fit_a_mixture_of_experts_the_search_finds_the_best_of_them() {
    let world = 4;
    let moe = ModelConfig::Llama(LlamaConfig {
        moe: Some(MoeConfig::new(8, 2, 512)),
        ..LlamaConfig::new(256, 32, 2, 4, 128)
    });
    let spec = moe.spec().unwrap();
    let a = analysis_of(&spec);
    assert_eq!(a.expert_sizes, [2, 4]);
    let sizes = Sizes { tensor: &[2], experts: &a.expert_sizes, ..NO_SIZES };
    let cands = candidates(&[], &[], true, sizes, false);
    let mut predictor = predictor_of(spec, &a, world);
    let mut peak = |l: &Layout| predictor.predict(l).unwrap().peak_bytes;
    let runnable: Vec<(Layout, u64)> = cands
        .iter()
        .filter(|l| on_cpu(l) && capability(l, Device::Cpu, world).is_none())
        .map(|l| (*l, peak(l)))
        .collect();
    let split = Candidate { tensor: 2, ..Candidate::plain(Precision::Fp32, Sharding::None, false) };
    let why = capability(&Layout::new(split).with_experts(4), Device::Cpu, world);
    assert_eq!(why.as_deref(), Some("expert groups of 4 ranks do not divide the 2 data ranks"));
    let whole = |l: &Layout| runnable.iter().find(|(r, _)| r == l).unwrap().1;
    let data = plain(Precision::Fp32, Sharding::None, false);
    assert!(whole(&data.with_experts(4)) < whole(&data.with_experts(2)) && whole(&data.with_experts(2)) < whole(&data));
    let budget = runnable.iter().filter(|(l, _)| l.experts == 1).map(|(_, p)| *p).min().unwrap() - 1;
    assert!(runnable.iter().any(|(l, p)| l.experts > 1 && *p <= budget), "no expert layout under {budget}");
    let peaks: BTreeMap<String, u64> = runnable.iter().map(|(l, p)| (l.label(), *p)).collect();
    // Larger groups exchange more: speed falls with the group's size, peaks as predicted.
    let cost = |l: &Layout| {
        let speed = trap_speed(&l.candidate) * [1.0, 1.0, 0.9, 0.0, 0.8][l.experts];
        Cost::Runs { tokens_per_s: speed, peak_bytes: peaks.get(&l.label()).copied().unwrap_or(u64::MAX) }
    };
    let mut table = Table::new(&cost);
    let limits = limits(world, Some(budget), None);
    let mut search = Search::new(&mut table, a, cands, &mut |l| predictor.predict(l), limits).unwrap();
    search.guided().unwrap();
    let best = search.best();
    let report = search.report(SearchMode::Guided, best).unwrap();
    let fitting: Vec<Layout> = runnable.iter().map(|(l, _)| *l).collect();
    let expected = table_best(&cost, &fitting, Some(budget));
    assert!(expected.contains("experts"), "{expected}");
    assert_eq!(report.chosen.as_deref(), Some(expected.as_str()));
    assert!(3 * table.runs.len() <= runnable.len(), "{} dry runs of {}", table.runs.len(), runnable.len());
}

/// bf16 on a CPU without bf16 units: every bf16 layout a fifth of its fp32 twin's speed.
fn slow_bf16(l: &Layout) -> Cost {
    let precision = if l.candidate.precision == Precision::Fp32 { 1.0 } else { 0.2 };
    Cost::Runs { tokens_per_s: precision * trap_speed(&l.candidate), peak_bytes: 1 }
}

/// A precision measured at a fifth of the fastest gets no alternatives of its own: the
/// search dry-runs its layouts only as the precision pass visits them from the fp32 leader
/// (a few), and still chooses the table's best.
#[test]
fn a_precision_far_slower_than_the_fastest_is_not_explored() {
    let cands = runnable();
    let mut table = Table::new(&slow_bf16);
    let report = run(&mut table, limits(2, None, None), SearchMode::Guided);
    assert_eq!(report.chosen.as_deref(), Some(table_best(&slow_bf16, &cands, None).as_str()));
    let bf16: std::collections::BTreeSet<&String> = table.runs.iter().filter(|l| l.contains("bf16")).collect();
    assert!(bf16.len() <= 4, "bf16 layouts explored: {bf16:?}");
}

/// The close finalists are dry-run again as often as `confirm_runs` says: twice more each
/// by default, never with 0, and the choice is the same.
#[test]
fn confirming_runs_re_measure_the_close_finalists_as_often_as_asked() {
    let dry_runs = |confirm_runs: usize| {
        let mut table = Table::new(&trap);
        let report = run(&mut table, SearchLimits { confirm_runs, ..limits(2, None, None) }, SearchMode::Guided);
        let explored = table.runs.iter().collect::<std::collections::BTreeSet<_>>().len();
        (report.chosen, explored, table.runs.len())
    };
    let (twice, explored, runs) = dry_runs(2);
    assert!(runs >= explored + 2, "{runs} dry runs of {explored} candidates");
    let (never, explored, runs) = dry_runs(0);
    assert_eq!(runs, explored, "each candidate once");
    assert_eq!(twice, never);
}
