//! `strata bench train`: the same GPT or LLaMA trained by Strata and by PyTorch eager (the
//! project's reference script, run with the project's virtual environment) in one run, side
//! by side, on the CPU or a GPU; optionally PyTorch under `torch.compile`, Strata with fp8
//! linears and Strata replaying a CUDA graph as further sides.
use crate::bench_runs::GptShape;
use crate::bench_step::{GpuPhases, Inspection, SyncSites, PHASES};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;
use strata::data::{Batch, Step};
use strata::engine::events::EventSinks;
use strata::engine::{memory, EngineConfig};
use strata::model::{GptConfig, LlamaConfig, ModelConfig};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{self, RankLayout};
use strata::profile;
use strata::strategy::Strategy;
use strata::train::Trainer;
use tch::{Device, Kind, Tensor};

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchModel {
    Gpt,
    Llama,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Amp {
    None,
    Bf16,
    Fp16,
}

impl Amp {
    fn name(self) -> &'static str {
        match self {
            Amp::None => "none",
            Amp::Bf16 => "bf16",
            Amp::Fp16 => "fp16",
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct BenchTrainArgs {
    #[command(flatten)]
    pub shape: GptShape,
    #[arg(long, value_enum, default_value_t = BenchModel::Gpt)]
    pub model: BenchModel,
    /// LLaMA: key/value heads of grouped-query attention (default: one per query head).
    #[arg(long)]
    pub kv_heads: Option<i64>,
    /// LLaMA: hidden size of the SwiGLU feed-forward (default 8/3 · dim rounded up to 32).
    #[arg(long)]
    pub ffn_dim: Option<i64>,
    #[arg(long, default_value_t = 256)]
    pub vocab: i64,
    #[arg(long, default_value_t = 8)]
    pub batch_size: i64,
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// Compute device of both sides: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Mixed precision of both sides: autocast in PyTorch, amp_native in Strata.
    #[arg(long, value_enum, default_value_t = Amp::None)]
    pub amp: Amp,
    /// A third side: Strata with fp8 linears (all but the output head) on top of --amp.
    #[arg(long)]
    pub fp8: bool,
    /// A further side: Strata with its step captured as a CUDA graph and replayed (on a GPU;
    /// the fp8 side stays eager, its delayed scaling reading maxima on the host).
    #[arg(long)]
    pub cuda_graph: bool,
    /// Every side recomputes each block's activations in backward (Strata's `checkpoint`,
    /// PyTorch's `torch.utils.checkpoint`), where memory needs it.
    #[arg(long)]
    pub checkpoint: bool,
    /// A further side: PyTorch with its forward and loss through `torch.compile` (the same
    /// model, batches and fused AdamW as its eager side).
    #[arg(long)]
    pub compile: bool,
    /// Each side started, warmed up, timed and looked into alone, and its device memory
    /// released before the next starts: for a GPU that cannot hold every side at once (the
    /// sides then do not share the machine's drifts as alternating blocks do).
    #[arg(long)]
    pub one_side_at_a_time: bool,
    /// Dense peak of the device in TFLOP/s for the model FLOPs utilisation (default: known
    /// from the GPU's name, bf16 without sparsity).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Measured blocks of each side, alternating between the sides.
    #[arg(long, default_value_t = 10)]
    pub rounds: u64,
    /// Training steps per block.
    #[arg(long, default_value_t = 5)]
    pub block: u64,
    /// Warm-up steps of each side before measuring.
    #[arg(long, default_value_t = 5)]
    pub warmup: u64,
    /// Python of the environment with torch (default: the checkout's .venv).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
    /// One more step of each side traced by libtorch's Kineto profiler into this folder
    /// (`<side>.json`, Chrome trace), and the device time per kernel (on a GPU) or the host's
    /// self time per operator (on the CPU) compared.
    #[arg(long)]
    pub kernel_trace: Option<PathBuf>,
}

impl BenchTrainArgs {
    fn model_config(&self) -> ModelConfig {
        let GptShape { layers, heads, dim, ctx } = self.shape;
        match self.model {
            BenchModel::Gpt => ModelConfig::Gpt(GptConfig::new(self.vocab, ctx, layers, heads, dim)),
            BenchModel::Llama => ModelConfig::Llama(LlamaConfig {
                kv_heads: self.kv_heads,
                ffn_dim: self.ffn_dim,
                ..LlamaConfig::new(self.vocab, ctx, layers, heads, dim)
            }),
        }
    }
}

/// What one side measured over all its blocks.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Measurement {
    pub side: String,
    pub tokens_per_s: f64,
    pub step_ms: f64,
    /// The loss of the side's last step: sides that start from the same weights and
    /// batches (Strata's, seeded alike) are compared by it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_loss: Option<f64>,
    /// Graphs `torch.compile` made for the side (PyTorch's compiled side).
    #[serde(skip_serializing_if = "is_zero")]
    pub compiled_graphs: u64,
    /// Model FLOPs utilisation, where the device's peak is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    pub peak_rss_bytes: u64,
    /// The device allocator's peak over a block (GPU only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes: Option<u64>,
    /// Host-device synchronisations of one step (GPU only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub syncs_per_step: Option<u64>,
    /// Where Strata's synchronisations of that step happened, and how many each.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub sync_sites: BTreeMap<String, u64>,
    /// GPU milliseconds of each part of that step (GPU only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub phases_ms: BTreeMap<String, f64>,
    /// Milliseconds per name of one traced step (`--kernel-trace`): each kernel's device
    /// time on a GPU, each operator's self time on the CPU.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub kernels_ms: BTreeMap<String, f64>,
}

#[derive(Serialize)]
pub struct Report {
    pub model: BenchModel,
    pub config: serde_json::Value,
    pub params: i64,
    pub batch_size: i64,
    pub device: String,
    pub amp: Amp,
    pub threads: i32,
    /// Model FLOPs of one token, forward and backward: 6 · parameters plus attention.
    pub flops_per_token: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
    /// Measured steps of each side.
    pub steps: u64,
    /// Whether each side ran alone (`--one-side-at-a-time`) rather than in alternating
    /// blocks.
    pub one_side_at_a_time: bool,
    /// PyTorch first, then Strata, then Strata with fp8 where asked for.
    pub sides: Vec<Measurement>,
    /// Strata tokens/s divided by PyTorch tokens/s.
    pub ratio: f64,
    /// Strata with fp8 against Strata without, tokens/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp8_ratio: Option<f64>,
    /// Strata replaying a CUDA graph against Strata without, tokens/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_ratio: Option<f64>,
    /// Strata against PyTorch under `torch.compile`, tokens/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compile_ratio: Option<f64>,
    /// Strata with fp8's last loss against Strata's without (the same weights, batches and
    /// steps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp8_loss_ratio: Option<f64>,
    /// Steps each side trained, warm-up included (the last loss is after these).
    pub trained_steps: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Milliseconds per call of `f` on `device` (a GPU's work waited for), over `calls` calls
/// after `warmup`.
pub fn per_call_ms<T>(device: Device, (warmup, calls): (u32, u32), mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let wait = || {
        if let Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
    };
    for _ in 0..warmup {
        f()?;
    }
    wait();
    let start = Instant::now();
    for _ in 0..calls {
        f()?;
    }
    wait();
    Ok(start.elapsed().as_secs_f64() * 1e3 / f64::from(calls))
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the PyTorch reference `scripts/SCRIPT` with `args` in the environment of `python`
/// (default: the checkout's .venv) and returns the JSON report it prints.
pub fn run_reference(python: Option<&PathBuf>, script: &str, args: &[String]) -> Result<serde_json::Value> {
    let python = python.cloned().unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    let out = Command::new(&python)
        .arg(repo_root().join("scripts").join(script))
        .args(args)
        .output()
        .with_context(|| format!("cannot run {} (run scripts/setup.sh first)", python.display()))?;
    if !out.status.success() {
        // A Python traceback ends with the exception: that line says what went wrong.
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message").trim();
        bail!("the PyTorch reference {script} failed: {last}");
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("the PyTorch reference {script} printed no JSON report"))
}

/// One timed block of steps.
struct Block {
    seconds: f64,
    /// The loss of the block's last step.
    loss: f64,
    /// Graphs `torch.compile` made so far (PyTorch's compiled side).
    compiled_graphs: u64,
    peak_rss_bytes: u64,
    peak_device_bytes: Option<u64>,
}

/// A trainer under measurement: runs blocks of steps, and looks into one step.
trait Side {
    fn run(&mut self, steps: u64) -> Result<Block>;
    fn inspect_step(&mut self) -> Result<Inspection>;
    /// Runs one step under the kernel tracer, its Chrome trace written to `path`.
    fn trace_step(&mut self, path: &Path) -> Result<()>;
}

/// `rows` rows of `length` tokens, each 1 to 8 past the one before (modulo `vocab`), from
/// random starts: the reference script's data. A model learns the rule within tens of steps
/// and cannot memorise it from a few batches, so the losses of sides after the same steps
/// compare them.
fn random_walks(vocab: i64, rows: i64, length: i64, device: Device) -> Result<Tensor> {
    let start = Tensor::f_randint(vocab, [rows, 1], (Kind::Int64, device))?;
    let steps = Tensor::f_randint_low(1, 9, [rows, length - 1], (Kind::Int64, device))?;
    let walked = start.f_add(&steps.f_cumsum(1, Kind::Int64)?)?;
    Ok(Tensor::f_cat(&[start, walked], 1)?.f_remainder(vocab)?)
}

/// Strata's side: a trainer and 16 fixed batches on the device, timed block by block.
struct StrataSide {
    trainer: Trainer,
    batches: Vec<Step>,
    device: Device,
    done: usize,
}

impl StrataSide {
    fn new(model: &ModelConfig, batch_size: i64, device: Device, strategy: &str, graph: bool) -> Result<StrataSide> {
        let strategy = Strategy::parse(strategy)?;
        let spec = model.spec()?;
        let config = EngineConfig { device, ..EngineConfig::default() };
        let mut engine = parallel::build_engine(spec, config, &strategy, &RankLayout::single())?;
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[])?;
        let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
        trainer.scaling = strategy.grad_scaling()?;
        if graph {
            trainer.capture_cuda_graph(strata::run::CUDA_GRAPH_WARMUP)?;
        }
        let ctx = model.context().context("the model has a context length")?;
        let batches = (0..16)
            .map(|i| {
                let t = random_walks(model.vocab(), batch_size, ctx + 1, device)?;
                Ok(Step::new(i, vec![Batch::new(t.narrow(1, 0, ctx), t.narrow(1, 1, ctx))?]))
            })
            .collect::<Result<_>>()?;
        Ok(StrataSide { trainer, batches, device, done: 0 })
    }

    /// Runs `steps` steps; the last one's loss (NaN for none).
    fn steps(&mut self, steps: u64) -> Result<f64> {
        let mut loss = f64::NAN;
        for _ in 0..steps {
            loss = self.trainer.train_step(&self.batches[self.done % self.batches.len()])?.loss;
            self.done += 1;
        }
        Ok(loss)
    }

    fn synchronize(&self) {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
    }
}

impl Side for StrataSide {
    fn run(&mut self, steps: u64) -> Result<Block> {
        self.synchronize();
        // What the process's other sides hold on the device stays out of this side's peak.
        let own = self.trainer.engine().ledger().report().get(&memory::Placement::Device).map_or(0, |r| r.current);
        let others = memory::allocator_current(self.device).unwrap_or(0).saturating_sub(own);
        let start = Instant::now();
        let loss = self.steps(steps)?;
        self.synchronize();
        let seconds = start.elapsed().as_secs_f64();
        Ok(Block {
            seconds,
            loss,
            compiled_graphs: 0,
            peak_rss_bytes: memory::process_peak_rss().unwrap_or(0),
            // A replayed graph allocates nothing: its step's memory is its pool's.
            peak_device_bytes: match self.device {
                Device::Cuda(_) => memory::allocator_peak(self.device)
                    .map(|peak| peak.saturating_sub(others) + self.trainer.graph_pool_bytes().unwrap_or(0)),
                _ => None,
            },
        })
    }

    fn inspect_step(&mut self) -> Result<Inspection> {
        let Device::Cuda(index) = self.device else { bail!("steps are looked into on a GPU") };
        self.synchronize();
        if self.trainer.graph_replays() > 0 {
            // A replay runs none of the host code that reports units and phases.
            strata_ext::cuda::count_syncs(true)?;
            let before = strata_ext::cuda::syncs_counted();
            let result = self.steps(1);
            strata_ext::cuda::count_syncs(false)?;
            result?;
            let syncs = strata_ext::cuda::syncs_counted() - before;
            return Ok(Inspection { syncs, sync_sites: BTreeMap::new(), phases_ms: BTreeMap::new() });
        }
        let sites = Arc::new(SyncSites::default());
        let phases = Arc::new(GpuPhases::new(index));
        self.trainer.engine_mut().set_event_sink(Arc::new(EventSinks(vec![sites.clone(), phases.clone()])));
        strata_ext::cuda::count_syncs(true)?;
        let before = strata_ext::cuda::syncs_counted();
        sites.start(before, "step start (before unit 0)");
        phases.mark(PHASES[0])?;
        let result = self.steps(1);
        sites.record_until_now("end of step (after the update)");
        strata_ext::cuda::count_syncs(false)?;
        result?;
        phases.mark("end")?;
        self.synchronize();
        let syncs = strata_ext::cuda::syncs_counted() - before;
        let sync_sites = sites.take();
        Ok(Inspection { syncs, sync_sites, phases_ms: phases.times()? })
    }

    fn trace_step(&mut self, path: &Path) -> Result<()> {
        self.synchronize();
        profile::kernels::start(matches!(self.device, Device::Cuda(_)))?;
        let result = self.steps(1);
        self.synchronize();
        profile::kernels::save(path)?;
        result.map(|_| ())
    }
}

/// PyTorch's side: the reference script serving blocks of steps over stdin/stdout.
struct PytorchSide {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl PytorchSide {
    /// The reference started for `a`'s model; `compile`: under `torch.compile`.
    fn start(a: &BenchTrainArgs, compile: bool) -> Result<PytorchSide> {
        let root = repo_root();
        let python = a.python.clone().unwrap_or_else(|| root.join(".venv/bin/python"));
        let n = |v: i64| v.to_string();
        let GptShape { layers, heads, dim, ctx } = a.shape;
        let model = match a.model {
            BenchModel::Gpt => "gpt",
            BenchModel::Llama => "llama",
        };
        let mut command = Command::new(&python);
        command
            .arg(root.join("scripts/torch_reference.py"))
            .args(["bench", "--model", model, "--vocab", &n(a.vocab), "--ctx", &n(ctx), "--layers", &n(layers)])
            .args(["--heads", &n(heads), "--dim", &n(dim), "--batch", &n(a.batch_size)])
            .args(["--threads", &a.threads.to_string(), "--grad-clip", "1.0"])
            .args(["--device", &a.device, "--amp", a.amp.name()]);
        for (flag, value) in [("--kv-heads", a.kv_heads), ("--ffn-dim", a.ffn_dim)] {
            if let Some(v) = value {
                command.args([flag, &n(v)]);
            }
        }
        for (flag, on) in [("--compile", compile), ("--checkpoint", a.checkpoint)] {
            if on {
                command.arg(flag);
            }
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {} (run scripts/setup.sh first)", python.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            bail!("no pipes to the PyTorch reference");
        };
        Ok(PytorchSide { child, stdin, stdout: BufReader::new(stdout) })
    }

    /// Sends one request line and reads the JSON answer.
    fn ask<T: for<'de> Deserialize<'de>>(&mut self, request: &str) -> Result<T> {
        writeln!(self.stdin, "{request}").context("the PyTorch reference stopped")?;
        let mut line = String::new();
        self.stdout.read_line(&mut line).context("the PyTorch reference stopped")?;
        serde_json::from_str(&line).with_context(|| {
            let status = self.child.try_wait().ok().flatten();
            format!("the PyTorch reference failed (exit {status:?}); run it by hand to see why")
        })
    }
}

impl Side for PytorchSide {
    fn run(&mut self, steps: u64) -> Result<Block> {
        #[derive(Deserialize)]
        struct Answer {
            seconds: f64,
            loss: f64,
            #[serde(default)]
            compiled_graphs: u64,
            peak_rss_bytes: u64,
            peak_device_bytes: Option<u64>,
        }
        let a: Answer = self.ask(&steps.to_string())?;
        Ok(Block {
            seconds: a.seconds,
            loss: a.loss,
            compiled_graphs: a.compiled_graphs,
            peak_rss_bytes: a.peak_rss_bytes,
            peak_device_bytes: a.peak_device_bytes,
        })
    }

    fn inspect_step(&mut self) -> Result<Inspection> {
        #[derive(Deserialize)]
        struct Answer {
            syncs: u64,
            phases_ms: BTreeMap<String, f64>,
        }
        let a: Answer = self.ask("inspect")?;
        Ok(Inspection { syncs: a.syncs, sync_sites: BTreeMap::new(), phases_ms: a.phases_ms })
    }

    fn trace_step(&mut self, path: &Path) -> Result<()> {
        let path = path.to_str().context("a kernel trace's path must be UTF-8")?;
        let _: serde_json::Value = self.ask(&format!("trace {path}"))?;
        Ok(())
    }
}

impl Drop for PytorchSide {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Dense (no sparsity) bf16 peak in TFLOP/s of the GPUs whose name says which they are.
fn known_peak_tflops(name: &str) -> Option<f64> {
    const PEAKS: [(&str, f64); 6] =
        [("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0)];
    PEAKS.iter().find(|(part, _)| name.contains(part)).map(|&(_, peak)| peak)
}

/// Strata's strategy for a side: fused attention and Strata's kernels (`module_replace`),
/// the reference's precision, fp8 linears and recomputed blocks where asked.
fn strata_strategy(a: &BenchTrainArgs, fp8: bool) -> String {
    let mut methods = vec![r#""module_replace""#.to_string()];
    if fp8 {
        methods.push(r#"["fp8", {"exclude": ["lm_head"]}]"#.into());
    }
    if a.checkpoint {
        let block = match a.model {
            BenchModel::Gpt => "GptBlock",
            BenchModel::Llama => "LlamaBlock",
        };
        methods.push(format!(r#"["checkpoint", ["{block}"]]"#));
    }
    let amp = a.amp;
    if amp != Amp::None {
        methods.push(format!(r#"["amp_native", {{"dtype": "{}"}}]"#, amp.name()));
    }
    format!("[{}]", methods.join(", "))
}

/// Measures every side of `a` in alternating blocks and reports them.
pub fn measure(a: &BenchTrainArgs) -> Result<Report> {
    let model = a.model_config();
    if a.rounds == 0 || a.block == 0 || a.batch_size <= 0 || a.threads <= 0 {
        bail!("rounds, block, batch size and threads must be positive");
    }
    let device = crate::options::parse_device(&a.device)?;
    let gpu = match device {
        Device::Cuda(i) => {
            let name = strata_ext::cuda::device_name(i).context("no usable GPU for --device")?;
            Some((i, name))
        }
        _ => None,
    };
    if a.fp8 && gpu.is_none() {
        bail!("--fp8 compares fp8 matrix products, which need a GPU (--device cuda)");
    }
    if a.cuda_graph && gpu.is_none() {
        bail!("--cuda-graph replays CUDA graphs, which need a GPU (--device cuda)");
    }
    if let Some(dir) = &a.kernel_trace {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    tch::set_num_threads(a.threads);
    // Every Strata side starts from the same weights and batches, whichever ran before it.
    let strata = |fp8, graph| -> Result<Box<dyn Side>> {
        tch::manual_seed(0);
        Ok(Box::new(StrataSide::new(&model, a.batch_size, device, &strata_strategy(a, fp8), graph)?))
    };
    let pytorch = |compile| -> Result<Box<dyn Side>> { Ok(Box::new(PytorchSide::start(a, compile)?)) };
    type Start<'a> = Box<dyn Fn() -> Result<Box<dyn Side>> + 'a>;
    let mut starts: Vec<(&str, Start)> =
        vec![("pytorch eager", Box::new(|| pytorch(false))), ("strata", Box::new(|| strata(false, false)))];
    if a.compile {
        starts.push((COMPILE_SIDE, Box::new(|| pytorch(true))));
    }
    if a.fp8 {
        starts.push((FP8_SIDE, Box::new(|| strata(true, false))));
    }
    if a.cuda_graph {
        starts.push((GRAPH_SIDE, Box::new(|| strata(false, true))));
    }
    let names: Vec<String> = starts.iter().map(|(name, _)| name.to_string()).collect();
    // Looked into after the timed blocks (that leaves its event sinks on Strata's engine);
    // a trace that fails leaves the timings standing.
    let look_into = |side: &mut Box<dyn Side>, name: &str| -> Result<(Option<Inspection>, BTreeMap<String, f64>)> {
        let inspection = gpu.as_ref().map(|_| side.inspect_step()).transpose()?;
        let Some(dir) = &a.kernel_trace else { return Ok((inspection, BTreeMap::new())) };
        let read =
            if gpu.is_some() { profile::kernels::device_ms_by_name } else { profile::kernels::host_self_ms_by_name };
        let path = dir.join(format!("{}.json", name.replace(' ', "-")));
        let traced = side.trace_step(&path).and_then(|()| Ok(read(&path)?));
        Ok((
            inspection,
            traced.unwrap_or_else(|e| {
                eprintln!("warning: no kernel trace of {name}: {e:#}");
                BTreeMap::new()
            }),
        ))
    };
    // What a side's device memory held goes back to the driver, for the next process.
    let release = |sides: Vec<Box<dyn Side>>| -> Result<()> {
        drop(sides);
        if gpu.is_some() {
            strata_ext::cuda::empty_cache()?;
        }
        Ok(())
    };
    let mut blocks: Vec<Vec<Block>> = Vec::new();
    let mut looked: Vec<(Option<Inspection>, BTreeMap<String, f64>)> = Vec::new();
    if a.one_side_at_a_time {
        for (name, start) in &starts {
            let mut side = start()?;
            side.run(a.warmup)?;
            blocks.push((0..a.rounds).map(|_| side.run(a.block)).collect::<Result<_>>()?);
            looked.push(look_into(&mut side, name)?);
            release(vec![side])?;
        }
    } else {
        let mut sides = starts.iter().map(|(_, start)| start()).collect::<Result<Vec<_>>>()?;
        for side in &mut sides {
            side.run(a.warmup)?;
        }
        // Short alternating blocks: every side sees the same drifts of a shared machine, and
        // only one of them runs at a time.
        blocks = sides.iter().map(|_| Vec::new()).collect();
        for _ in 0..a.rounds {
            for (side, done) in sides.iter_mut().zip(&mut blocks) {
                done.push(side.run(a.block)?);
            }
        }
        for (side, name) in sides.iter_mut().zip(&names) {
            looked.push(look_into(side, name)?);
        }
        release(sides)?;
    }
    let spec = model.spec()?;
    let params = spec.num_params();
    let flops_per_token = strata::auto::step_time::model_flops_per_token(&spec, model.context().unwrap_or(0))?;
    let peak_tflops = a.peak_tflops.or_else(|| gpu.as_ref().and_then(|(_, name)| known_peak_tflops(name)));
    let steps = a.rounds * a.block;
    let ctx = model.context().unwrap_or(0);
    let tokens = (steps as i64 * a.batch_size * ctx) as f64;
    let measured: Vec<Measurement> = names
        .into_iter()
        .zip(blocks)
        .zip(looked)
        .map(|((side, blocks), (inspection, kernels_ms))| {
            let seconds: f64 = blocks.iter().map(|b| b.seconds).sum();
            let tokens_per_s = tokens / seconds;
            let (syncs_per_step, sync_sites, phases_ms) = match inspection {
                Some(i) => (Some(i.syncs), i.sync_sites, i.phases_ms),
                None => (None, BTreeMap::new(), BTreeMap::new()),
            };
            Measurement {
                side,
                tokens_per_s,
                step_ms: 1000.0 * seconds / steps as f64,
                final_loss: blocks.last().map(|b| b.loss),
                compiled_graphs: blocks.iter().map(|b| b.compiled_graphs).max().unwrap_or(0),
                mfu: peak_tflops.map(|peak| tokens_per_s * flops_per_token / (peak * 1e12)),
                peak_rss_bytes: blocks.iter().map(|b| b.peak_rss_bytes).max().unwrap_or(0),
                peak_device_bytes: blocks.iter().filter_map(|b| b.peak_device_bytes).max(),
                syncs_per_step,
                sync_sites,
                phases_ms,
                kernels_ms,
            }
        })
        .collect();
    let ratio = measured[1].tokens_per_s / measured[0].tokens_per_s;
    let against_strata =
        |name: &str| measured.iter().find(|m| m.side == name).map(|m| m.tokens_per_s / measured[1].tokens_per_s);
    let (fp8_ratio, graph_ratio) = (against_strata(FP8_SIDE), against_strata(GRAPH_SIDE));
    let compile_ratio = against_strata(COMPILE_SIDE).map(|r| 1.0 / r);
    let final_loss = |name: &str| measured.iter().find(|m| m.side == name).and_then(|m| m.final_loss);
    let fp8_loss_ratio = final_loss(FP8_SIDE).zip(final_loss("strata")).map(|(fp8, bf16)| fp8 / bf16);
    Ok(Report {
        model: a.model,
        config: serde_json::to_value(&model)?,
        params,
        batch_size: a.batch_size,
        device: gpu.map_or_else(|| "cpu".to_string(), |(_, name)| name),
        amp: a.amp,
        threads: a.threads,
        flops_per_token,
        peak_tflops,
        steps,
        one_side_at_a_time: a.one_side_at_a_time,
        sides: measured,
        ratio,
        fp8_ratio,
        graph_ratio,
        compile_ratio,
        fp8_loss_ratio,
        trained_steps: a.warmup + steps,
    })
}

/// The names of the sides beside PyTorch's and Strata's plain one.
const FP8_SIDE: &str = "strata fp8";
const GRAPH_SIDE: &str = "strata graph";
const COMPILE_SIDE: &str = "pytorch compile";

/// Prints `report` as a small table.
pub fn print(report: &Report, block: u64) {
    let c = &report.config;
    let field = |k: &str| c.get(k).and_then(|v| v.as_i64()).unwrap_or(0);
    println!(
        "{:?} {:.0}M parameters ({} layers, {} heads, dim {}, ctx {}, vocab {}), batch {}, amp {}, on {}; {} steps each, in {} blocks of {}",
        report.model,
        report.params as f64 / 1e6,
        field("layers"),
        field("heads"),
        field("dim"),
        field("ctx"),
        field("vocab"),
        report.batch_size,
        report.amp.name(),
        report.device,
        report.steps,
        if report.one_side_at_a_time { "one side's" } else { "alternating" },
        block
    );
    if let Some(peak) = report.peak_tflops {
        println!("MFU: {:.2} GFLOP per token over a dense peak of {peak:.0} TFLOP/s", report.flops_per_token / 1e9);
    }
    println!(
        "{:<15} {:>11} {:>9} {:>6} {:>15} {:>13} {:>11} {:>10}",
        "", "tokens/s", "ms/step", "MFU %", "peak device MiB", "peak RSS MiB", "syncs/step", "last loss"
    );
    let mib = |b: u64| b as f64 / 1048576.0;
    for m in &report.sides {
        let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        println!(
            "{:<15} {:>11.0} {:>9.1} {:>6} {:>15} {:>13.1} {:>11} {:>10}",
            m.side,
            m.tokens_per_s,
            m.step_ms,
            or_dash(m.mfu.map(|u| format!("{:.1}", 100.0 * u))),
            or_dash(m.peak_device_bytes.map(|b| format!("{:.0}", mib(b)))),
            mib(m.peak_rss_bytes),
            or_dash(m.syncs_per_step.map(|n| n.to_string())),
            or_dash(m.final_loss.map(|l| format!("{l:.4}"))),
        );
        for (site, n) in &m.sync_sites {
            println!("{:<14}   {n} sync at {site}", "");
        }
    }
    if report.sides.iter().any(|m| !m.phases_ms.is_empty()) {
        print!("{:<24}", "GPU ms of one step");
        report.sides.iter().for_each(|m| print!(" {:>14}", m.side));
        println!();
        for phase in PHASES {
            print!("{:<24}", &phase[2..]);
            for m in &report.sides {
                print!(" {:>14.2}", m.phases_ms.get(phase).copied().unwrap_or(0.0));
            }
            println!();
        }
    }
    if report.sides.iter().any(|m| !m.kernels_ms.is_empty()) {
        let on_gpu = report.device != "cpu";
        print_kernels(&report.sides, if on_gpu { TracedTime::Device } else { TracedTime::HostSelf });
    }
    println!("strata / pytorch tokens/s: {:.3}", report.ratio);
    if let Some(r) = report.fp8_ratio {
        println!("{FP8_SIDE} / strata tokens/s: {r:.3}");
    }
    if let Some(r) = report.fp8_loss_ratio {
        println!("{FP8_SIDE} / strata loss after {} steps: {r:.4}", report.trained_steps);
    }
    if let Some(r) = report.graph_ratio {
        println!("{GRAPH_SIDE} / strata tokens/s: {r:.3}");
    }
    if let Some(r) = report.compile_ratio {
        println!("strata / {COMPILE_SIDE} tokens/s: {r:.3}");
    }
}

/// What a traced step's times per name are.
#[derive(Clone, Copy)]
pub enum TracedTime {
    /// Device time per kernel, copy and fill.
    Device,
    /// The host's self time per operator.
    HostSelf,
}

/// The kernels (or operators) that took the most time in any side's traced step, side by
/// side, and every one's time in all.
pub fn print_kernels(sides: &[Measurement], what: TracedTime) {
    const SHOWN: usize = 16;
    let by_label: Vec<BTreeMap<String, f64>> = sides
        .iter()
        .map(|m| {
            let mut out = BTreeMap::new();
            for (name, ms) in &m.kernels_ms {
                *out.entry(kernel_label(name)).or_default() += ms;
            }
            out
        })
        .collect();
    // Each label with the most any side spent in it, most first.
    let mut most: BTreeMap<&String, f64> = BTreeMap::new();
    for (label, &ms) in by_label.iter().flatten() {
        let m = most.entry(label).or_default();
        *m = m.max(ms);
    }
    let mut labels: Vec<(&String, f64)> = most.into_iter().collect();
    labels.sort_by(|a, b| b.1.total_cmp(&a.1));
    let (heading, each) = match what {
        TracedTime::Device => ("device ms of one traced step, by kernel", "kernels"),
        TracedTime::HostSelf => ("host ms of one traced step, by operator (self time)", "operators"),
    };
    print!("{heading:<64}");
    sides.iter().for_each(|m| print!(" {:>14}", m.side));
    println!();
    for (label, _) in labels.iter().take(SHOWN) {
        print!("{label:<64}");
        by_label.iter().for_each(|m| print!(" {:>14.2}", m.get(*label).copied().unwrap_or(0.0)));
        println!();
    }
    let kernels: std::collections::BTreeSet<&String> = sides.iter().flat_map(|m| m.kernels_ms.keys()).collect();
    print!("{:<64}", format!("all {} {each}", kernels.len()));
    by_label.iter().for_each(|m| print!(" {:>14.2}", m.values().sum::<f64>()));
    println!();
}

/// A kernel's name cut to a table column: without the return type, the namespaces that
/// every kernel of a library shares, and the argument list.
fn kernel_label(name: &str) -> String {
    let name = name.strip_prefix("void ").unwrap_or(name);
    let name = name.replace("at::native::", "").replace("(anonymous namespace)::", "");
    let name = match name.find('(') {
        Some(i) if i > 0 => &name[..i],
        _ => &name,
    };
    name.chars().take(63).collect()
}

pub fn run(a: BenchTrainArgs) -> Result<()> {
    let report = measure(&a)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&report, a.block);
    }
    Ok(())
}
