//! The `strata` command line. Parses flags, hands typed settings to the library, and turns
//! every failure into one line on stderr with a non-zero exit.
//!
//! Owns the command tree and the dispatch. Must not do the commands' work: each calls the
//! library (the larger ones from files of their own), which trains, measures and reads.
mod bench;
mod bench_checkpoint;
mod bench_comm;
mod bench_dist;
mod bench_estimate;
mod bench_generate;
mod bench_gpu;
mod bench_kernels;
mod bench_long;
mod bench_methods;
mod bench_moe;
mod bench_offload;
mod bench_parallel;
mod bench_pipeline;
mod bench_runs;
mod bench_search;
mod bench_step;
mod bench_tokenize;
mod bench_zero;
#[cfg(test)]
mod cli_docs;
mod estimate_cmd;
mod fork_server;
mod infer;
mod launch;
mod options;
mod plan_cmd;
mod profile_cmd;
mod reward_command;
mod tokenize_cmd;
mod train;

use clap::{Parser, Subcommand};
use std::ffi::{OsStr, OsString};
use std::io::Write;

#[derive(Parser)]
#[command(name = "strata", version, about = "Train large neural networks fast and within memory")]
#[command(args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (the embedded synthetic corpus unless --data or --token-file is given).
    Train(Box<options::TrainOptions>),
    /// Validation loss and perplexity of a model folder or checkpoint on given data.
    Eval(Box<infer::EvalArgs>),
    /// Continue a prompt with a model folder or checkpoint: greedy or sampled, key/value cached.
    Generate(Box<infer::GenerateArgs>),
    /// Tokenize text files into one token file for --token-file (streaming, on every core).
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Will it fit? Per layout, each rank's peak device and host bytes by what holds them,
    /// from the model's configuration alone (no allocation, no run).
    Estimate(Box<estimate_cmd::EstimateArgs>),
    /// How should it run? The fastest layouts for a described cluster, by predicted step
    /// time among those that fit, and the best as a strategy file.
    Plan(Box<plan_cmd::PlanArgs>),
    /// Start the ranks of a job on this node (as torchrun): strata launch --nproc-per-node N -- CMD ARGS
    Launch(launch::LaunchArgs),
    /// Benchmarks, each against a reference measured in the same run.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
    /// Strategies: show one with every default written out, or validate it.
    Strategy {
        #[command(subcommand)]
        which: StrategyCommand,
    },
    /// Checkpoints: merge the per-rank shards of one into a single file.
    Ckpt {
        #[command(subcommand)]
        which: CkptCommand,
    },
    /// Profiles recorded by `strata train --profile DIR`: a Chrome trace, a summary, pictures.
    Profile {
        #[command(subcommand)]
        which: profile_cmd::ProfileCommand,
    },
    /// Draw training metrics (`strata train --metrics FILE`) of one or more runs, overlaid.
    Plot(profile_cmd::PlotArgs),
    /// Run commands sent over a Unix socket, each in a copy of this process (for harnesses
    /// that run many short commands).
    #[command(hide = true)]
    ForkServer(fork_server::ForkServerArgs),
}

#[derive(Subcommand)]
enum StrategyCommand {
    /// Print a strategy (a file or JSON text) in list form with every default; with
    /// --world-size, the device mesh it makes of that many ranks too.
    Show {
        strategy: String,
        #[command(flatten)]
        world: MeshWorld,
    },
    /// Check a strategy (a file or JSON text); with --world-size, its device mesh too.
    Validate {
        strategy: String,
        #[command(flatten)]
        world: MeshWorld,
    },
}

/// The ranks a strategy's mesh is shown for.
#[derive(clap::Args)]
struct MeshWorld {
    /// Ranks in the job.
    #[arg(long)]
    world_size: Option<usize>,
    /// Ranks per host (HYBRID_SHARD's default shard group); default: every rank on one host.
    #[arg(long, requires = "world_size")]
    local_world_size: Option<usize>,
}

impl MeshWorld {
    fn mesh(&self, strategy: &strata::strategy::Strategy) -> anyhow::Result<Option<strata::parallel::Mesh>> {
        let Some(world) = self.world_size else { return Ok(None) };
        Ok(Some(strata::parallel::Mesh::new(strategy, world, 0, self.local_world_size.unwrap_or(world))?))
    }

    /// The mesh's sizes and, for each dimension above 1, its groups.
    fn describe(&self, strategy: &strata::strategy::Strategy) -> anyhow::Result<Option<String>> {
        let Some(mesh) = self.mesh(strategy)? else { return Ok(None) };
        let mut lines = vec![format!("mesh at {} ranks: {mesh}", mesh.world())];
        for &(dim, size) in mesh.dims().iter().filter(|(_, s)| *s > 1) {
            let groups: Vec<String> = mesh.groups(&[dim]).iter().map(|g| format!("{g:?}")).collect();
            lines.push(format!("  {dim} ({size}): {}", groups.join(" ")));
        }
        Ok(Some(lines.join("\n")))
    }
}

#[derive(Subcommand)]
enum CkptCommand {
    /// Merge a sharded checkpoint into one safetensors file: weights under their names,
    /// optimizer states as optim.<state>.<name>; --resume and --init-weights accept it.
    Merge {
        /// A checkpoint folder (its latest checkpoint) or one step's folder.
        checkpoint: std::path::PathBuf,
        /// The merged file to write.
        output: std::path::PathBuf,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Training throughput of a GPT or LLaMA in Strata and in PyTorch eager (and under
    /// torch.compile), side by side, on the CPU or a GPU.
    Train(bench::BenchTrainArgs),
    /// On one GPU: GPT-2 124M and a 1.1B LLaMA in bf16, Strata against PyTorch eager and
    /// compiled; an 8B-shaped slice in fp8 against bf16; products, experts and attention.
    Gpu(bench_gpu::BenchGpuArgs),
    /// Collective bandwidth per backend and size, with memcpy bandwidth as the reference.
    Comm(bench_comm::BenchCommArgs),
    /// Per-rank model-state memory of ddp/zero1/zero2/fsdp against the ZeRO formula, and
    /// their throughput against plain data parallelism.
    Zero(bench_zero::BenchZeroArgs),
    /// amp_native, half, fp8, checkpoint and module_replace each against none: tokens/s,
    /// peak allocated bytes and model-state bytes.
    Methods(bench_methods::BenchMethodsArgs),
    /// A mixture of experts: the experts' products grouped by expert against one product of
    /// equal FLOPs, the all-to-all against memcpy, and tokens/s at expert parallel 1, 2, 4.
    Moe(bench_moe::BenchMoeArgs),
    /// Data parallelism and fsdp against PyTorch DDP and FSDP2 over gloo at several world
    /// sizes: tokens/s, the ratio, and memory peaks.
    Dist(bench_dist::BenchDistArgs),
    /// The guided strategy search against an exhaustive one per scenario: dry runs spent,
    /// and the guided choice trained side by side with the exhaustive best.
    Search(bench_search::BenchSearchArgs),
    /// Tensor parallelism (with and without sequence parallel) beside data parallelism,
    /// zero2 and fsdp: tokens/s against data parallelism, model-state and allocator peaks.
    Parallel(bench_parallel::BenchParallelArgs),
    /// Pipeline schedules at several micro-batch counts: tokens/s, measured bubble against
    /// the analytic one, micro-batches held and activation peaks per stage.
    Pipeline(bench_pipeline::BenchPipelineArgs),
    /// The largest GPT each placement (none, optimizer on the host, everything on the host,
    /// auto) trains within a device and a host budget: tokens/s, bytes moved, copy-wait.
    Offload(bench_offload::BenchOffloadArgs),
    /// The longest row a LLaMA trains within a device budget under each long-row method
    /// added in turn (recomputation, chunked loss, activation offload, context parallel 2
    /// and 4), with tokens/s.
    Long(bench_long::BenchLongArgs),
    /// strata tokenize against tokenizers' batch encoding in Python on the same text, pieces
    /// and tokenizer: MB/s, tokens/s, the ratio, and a check of equal ids.
    Tokenize(bench_tokenize::BenchTokenizeArgs),
    /// Strata's CPU kernels (GELU, RMSNorm, SwiGLU, rotary positions, oneDNN's linear)
    /// against the libtorch operators they replace: milliseconds, the ratio, the difference.
    Kernels(bench_kernels::BenchKernelsArgs),
    /// Batched greedy decoding against transformers' generate on the same LLaMA folder and
    /// prompts: tokens/s, the ratio, one prompt at a time beside them.
    Generate(bench_generate::BenchGenerateArgs),
    /// The memory estimate of `strata estimate` against the allocator's peak of real runs
    /// over families, sizes, layouts and 1–4 ranks: each error, their median, the worst.
    Estimate(bench_estimate::BenchEstimateArgs),
    /// A checkpoint after every step, synchronous against asynchronous, beside no
    /// checkpoints: the time each save stops training, the writer's, and tokens/s.
    Checkpoint(bench_checkpoint::BenchCheckpointArgs),
}

fn show(text: &str, world: &MeshWorld) -> anyhow::Result<()> {
    let strategy = options::parse_strategy(text)?;
    println!("{}", strategy.to_json());
    if let Some(mesh) = world.describe(&strategy)? {
        println!("{mesh}");
    }
    Ok(())
}

fn validate(text: &str, world: &MeshWorld) -> anyhow::Result<()> {
    let strategy = options::parse_strategy(text)?;
    let methods: Vec<&str> = strategy.methods.iter().map(|m| m.name()).collect();
    match world.mesh(&strategy)? {
        Some(mesh) => {
            let layout: Vec<String> = mesh
                .dims()
                .iter()
                .filter(|(_, size)| *size > 1)
                .map(|&(dim, size)| format!("{dim}: {} groups of {size}", mesh.world() / size))
                .collect();
            println!("valid: {} (at {} ranks: {})", methods.join(", "), mesh.world(), layout.join("; "));
        }
        None => println!("valid: {}", methods.join(", ")),
    }
    Ok(())
}

fn merge(checkpoint: &std::path::Path, output: &std::path::Path) -> anyhow::Result<()> {
    let ckpt = strata::checkpoint::Checkpoint::open(checkpoint)?;
    ckpt.merge(output)?;
    println!(
        "merged step {} ({} rank files, world size {}) into {}",
        ckpt.meta.step,
        ckpt.meta.files.len(),
        ckpt.meta.world_size,
        output.display()
    );
    Ok(())
}

/// Makes glibc's malloc, which serves libtorch's CPU tensors, keep freed memory for reuse.
/// By default it maps every block of 128 KiB or more afresh and unmaps it when freed, so
/// each training step faults in and zeroes the pages of its activations again (about 2 700
/// page faults a step for the 4-layer GPT of `bench dist`). With the threshold at glibc's
/// maximum (32 MiB) and no trimming, freed blocks serve the next step, as a caching allocator
/// would: the process keeps its peak resident. A user's own `GLIBC_TUNABLES` for malloc wins.
fn keep_freed_heap_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
            return;
        }
        // SAFETY: mallopt only changes malloc's parameters, under malloc's own lock.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        }
    }
}

fn main() {
    let args: Vec<OsString> = std::env::args_os().collect();
    end_process(start(&args))
}

/// Whether this process has loaded the CUDA driver (or cannot tell).
fn gpu_driver_loaded() -> bool {
    std::fs::read_to_string("/proc/self/maps").map_or(true, |maps| maps.contains("libcuda.so"))
}

/// Ends the process with `status`. Unless a GPU driver is loaded, without the exit
/// handlers: libtorch's static destructors unregister every operator one by one (about
/// 0.2 s of CPU here, two fifths of a short command's), and nothing of ours is left to them
/// (files are closed and threads joined by the time a command returns; MPI is finalised
/// and buffered output flushed here). With a GPU driver, the usual exit, so that CUDA's
/// and NCCL's handlers run as they expect.
fn end_process(status: u8) -> ! {
    let _ = std::io::stdout().flush();
    if gpu_driver_loaded() {
        std::process::exit(i32::from(status));
    }
    strata::comm::finish_process();
    // SAFETY: flushes C's buffered streams (C++'s are synchronised with them), then ends the
    // process at once.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(i32::from(status))
    }
}

/// Runs the command line `args` (the program first) as a fresh process does: parsed, the
/// heap and the log set up, then the command; the process's exit status.
fn start<T: AsRef<OsStr>>(args: &[T]) -> u8 {
    let args: Vec<OsString> = args.iter().map(|a| a.as_ref().to_owned()).collect();
    let command = match parse(&args) {
        Ok(cli) => cli.command,
        Err(status) => return status,
    };
    if let Command::ForkServer(a) = command {
        // Before the log: each command the server forks sets up its own.
        return report(fork_server::serve(a));
    }
    keep_freed_heap_memory();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    run(command, &args)
}

/// The command line `args` (the program first) parsed, or the exit status once clap has
/// said why not in one line (or printed the help or version asked for).
fn parse(args: &[OsString]) -> Result<Cli, u8> {
    match Cli::try_parse_from(args) {
        Ok(cli) => Ok(cli),
        Err(e) if e.use_stderr() => {
            // One line: clap's first line names the problem; the usage is one --help away.
            let text = e.render().to_string();
            eprintln!("{} (see --help)", text.lines().next().unwrap_or("invalid arguments"));
            Err(2)
        }
        Err(e) => {
            let _ = e.print();
            Err(0)
        }
    }
}

/// Runs `args` (the program first) as a fresh `strata` process would: the entry of a rank
/// that the launcher forked from itself, where `main`'s set-up is already done.
fn run_in_forked_process(args: &[String]) -> u8 {
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    parse(&args).map_or_else(|status| status, |cli| run(cli.command, &args))
}

/// Runs `command`, parsed from `command_line`; the process's exit status.
fn run(command: Command, command_line: &[OsString]) -> u8 {
    report(match command {
        Command::Train(o) => o.resolve().and_then(|settings| match settings.nproc {
            // Not yet one of the ranks: start them.
            n if n > 1 && std::env::var_os("RANK").is_none() => launch::relaunch_self(command_line, n, "--nproc", None),
            _ => train::run(settings),
        }),
        Command::Launch(a) => launch::run(a),
        Command::Tokenize(a) => tokenize_cmd::run(a),
        Command::Eval(a) => infer::eval(*a),
        Command::Generate(a) => infer::run_generate(*a),
        Command::Estimate(a) => estimate_cmd::run(*a),
        Command::Plan(a) => plan_cmd::run(*a),
        Command::Bench { which: BenchCommand::Train(a) } => bench::run(a),
        Command::Bench { which: BenchCommand::Gpu(a) } => bench_gpu::run(a),
        Command::Bench { which: BenchCommand::Kernels(a) } => bench_kernels::run(a),
        Command::Bench { which: BenchCommand::Comm(a) } => bench_comm::run(a, command_line),
        Command::Bench { which: BenchCommand::Zero(a) } => bench_zero::run(a),
        Command::Bench { which: BenchCommand::Parallel(a) } => bench_parallel::run(a),
        Command::Bench { which: BenchCommand::Pipeline(a) } => bench_pipeline::run(a),
        Command::Bench { which: BenchCommand::Methods(a) } => bench_methods::run(a),
        Command::Bench { which: BenchCommand::Moe(a) } => bench_moe::run(a),
        Command::Bench { which: BenchCommand::Search(a) } => bench_search::run(a),
        Command::Bench { which: BenchCommand::Dist(a) } => bench_dist::run(a),
        Command::Bench { which: BenchCommand::Offload(a) } => bench_offload::run(a),
        Command::Bench { which: BenchCommand::Long(a) } => bench_long::run(a),
        Command::Bench { which: BenchCommand::Tokenize(a) } => bench_tokenize::run(a),
        Command::Bench { which: BenchCommand::Estimate(a) } => bench_estimate::run(a),
        Command::Bench { which: BenchCommand::Generate(a) } => bench_generate::run(a),
        Command::Bench { which: BenchCommand::Checkpoint(a) } => bench_checkpoint::run(a),
        Command::Ckpt { which: CkptCommand::Merge { checkpoint, output } } => merge(&checkpoint, &output),
        Command::Profile { which } => profile_cmd::run(which),
        Command::Plot(a) => profile_cmd::plot_metrics(a),
        Command::Strategy { which: StrategyCommand::Show { strategy, world } } => show(&strategy, &world),
        Command::Strategy { which: StrategyCommand::Validate { strategy, world } } => validate(&strategy, &world),
        Command::ForkServer(a) => fork_server::serve(a),
    })
}

/// The exit status of a command's result, after an error is said in one line.
fn report(result: anyhow::Result<()>) -> u8 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}
