//! `strata bench comm`: collectives of each backend over a range of sizes, in the style of
//! nccl-tests (time, algorithm bandwidth, bus bandwidth), with this machine's memcpy
//! bandwidth (every rank at once, in rounds alternating with each large row's; one process
//! alone) and PyTorch's gloo backend (`scripts/torch_comm_reference.py`, same operations,
//! sizes and timing rule) measured in the same run as the references.
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use strata::comm::{all_reduce_values, init_from_env, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

#[derive(Args, Debug, Clone)]
pub struct BenchCommArgs {
    /// Start this many local ranks through `strata launch` (otherwise run as one rank of a
    /// job already launched).
    #[arg(long)]
    nproc: Option<usize>,
    /// Backends to measure, comma-separated.
    #[arg(long, default_value = "shm,tcp")]
    backends: String,
    /// Operations: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all (each rank
    /// sends a block of its buffer to every rank).
    #[arg(long, default_value = "all_reduce,all_gather,reduce_scatter,broadcast")]
    ops: String,
    #[arg(long, default_value_t = 4 << 10)]
    min_bytes: usize,
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Buffers to measure with, comma-separated: `private` (ordinary tensors) and `shared`
    /// (allocated by the group, read in place by peers; only where the backend offers it).
    #[arg(long, default_value = "private,shared")]
    buffers: String,
    /// Also measure all-gather and reduce-scatter in place (the input is the output's own
    /// block, or the output the input's).
    #[arg(long)]
    in_place: bool,
    /// Size growth factor between rows.
    #[arg(long, default_value_t = 4)]
    factor: usize,
    /// Timed rounds per row (the iterations split between them); a row reports the median
    /// round, which a passing stall on a shared machine does not move.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Untimed runs before each row's timed ones, on every side (as nccl-tests' -w): the
    /// first runs map buffers, and shm's first six large calls of a kind try both of its
    /// slot stores before it keeps the faster.
    #[arg(long, default_value_t = 8)]
    warmup: usize,
    /// Print the results as JSON (rank 0).
    #[arg(long)]
    json: bool,
    /// Skip the PyTorch gloo reference.
    #[arg(long)]
    no_reference: bool,
    /// Python of the environment with torch (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    backend: String,
    /// `private` or `shared` buffers.
    buffers: String,
    /// All-gather's input is its output's own block / reduce-scatter's output its input's.
    in_place: bool,
    op: String,
    bytes: usize,
    time_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    /// PyTorch gloo's time for the same operation and size, measured after Strata's.
    gloo_time_us: Option<f64>,
    /// gloo's time over this row's: above 1, Strata is faster.
    speedup_vs_gloo: Option<f64>,
    /// From [`MEMCPY_FROM`] bytes: every rank copying `bytes` bytes with memcpy at once, in
    /// rounds alternating with this row's, the slowest rank's GB/s (median round). The
    /// memory bus's pace drifts on a shared machine; measured beside the row, it is the
    /// pace the row had, and bounds what a copy inside the collective could reach.
    memcpy_beside_gbps: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    world_size: usize,
    /// One process copying alone, after the collectives: (bytes, GB/s). (Every rank
    /// copying at once is measured beside each row: [`Row::memcpy_beside_gbps`].)
    memcpy_gbps: Vec<(usize, f64)>,
    /// Copies with streaming stores (what the shm collectives write large outputs with,
    /// usually the fastest copy on this machine), after the collectives: one process alone
    /// and every rank at once (the slowest rank's GB/s).
    streaming_copy_gbps: Vec<(usize, f64)>,
    streaming_copy_every_rank_gbps: Vec<(usize, f64)>,
    rows: Vec<Row>,
    /// With two ranks or more.
    idle_wait: Option<IdleWait>,
}

/// What a rank waiting in a collective costs the rank that computes: the same matrix
/// products on rank 0 (with every core's thread) while the other ranks block in the kernel
/// on a store read, and while they wait for it in a barrier of the measured backend.
#[derive(Serialize)]
struct IdleWait {
    backend: String,
    compute_threads: usize,
    /// Median seconds of the work beside peers blocked in the kernel.
    beside_blocked_peers_s: f64,
    /// Median seconds of the work beside peers waiting in a barrier.
    beside_waiting_peers_s: f64,
    /// The second over the first: 1 means waiting peers take nothing from compute.
    slowdown: f64,
}

/// Times the same matrix products on rank 0 beside peers blocked on the store and beside
/// peers waiting in `g`'s barrier, alternately, `rounds` times each.
fn idle_wait(comm: &strata::comm::Comm, g: &dyn ProcessGroup, backend: &str) -> Result<IdleWait> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    tch::set_num_threads(threads as i32);
    let a = Tensor::randn([384, 384], (Kind::Float, Device::Cpu));
    let work = || {
        let start = Instant::now();
        for _ in 0..200 {
            let _ = a.matmul(&a);
        }
        start.elapsed().as_secs_f64()
    };
    let (mut blocked, mut waiting) = (Vec::new(), Vec::new());
    for round in 0..5 {
        g.barrier()?.wait()?;
        let key = format!("bench-comm/idle/{round}");
        if comm.rank() == 0 {
            blocked.push(work());
            comm.store().set(&key, b"done")?;
        } else {
            comm.store().get(&key)?;
        }
        g.barrier()?.wait()?;
        if comm.rank() == 0 {
            waiting.push(work());
        }
        g.barrier()?.wait()?;
    }
    let (blocked, waiting) = (crate::bench_runs::median(blocked), crate::bench_runs::median(waiting));
    Ok(IdleWait {
        backend: backend.to_string(),
        compute_threads: threads,
        beside_blocked_peers_s: blocked,
        beside_waiting_peers_s: waiting,
        slowdown: waiting / blocked.max(1e-12),
    })
}

/// Bus bandwidth over algorithm bandwidth: the share of the data each rank's links carry.
fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Sizes from which memcpy is the reference (below it, caches rather than the memory bus
/// set the pace).
const MEMCPY_FROM: usize = 16 << 20;

/// A source and a destination of one size, both touched, for timing copies.
struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    fn new(bytes: usize) -> Memcpy {
        let mut m = Memcpy { src: vec![1u8; bytes], dst: vec![0u8; bytes] };
        m.copy(false);
        m
    }

    fn copy(&mut self, streaming: bool) {
        if streaming {
            strata::comm::copy_streaming(&mut self.dst, std::hint::black_box(&self.src))
        } else {
            self.dst.copy_from_slice(std::hint::black_box(&self.src))
        }
    }

    /// GB/s of `iters` copies with memcpy or, with `streaming`, with streaming stores.
    fn gbps(&mut self, iters: usize, streaming: bool) -> f64 {
        let start = Instant::now();
        for _ in 0..iters {
            self.copy(streaming);
        }
        std::hint::black_box(&self.dst);
        (self.src.len() * iters) as f64 / start.elapsed().as_secs_f64() / 1e9
    }
}

/// GB/s of copying `bytes` bytes (1 GiB in all, 3 to 200 copies).
fn copy_gbps(bytes: usize, streaming: bool) -> f64 {
    Memcpy::new(bytes).gbps((1usize << 30).div_ceil(bytes).clamp(3, 200), streaming)
}

/// A row's seconds per run and, from [`MEMCPY_FROM`] bytes, the memcpy GB/s beside it.
struct Timing {
    seconds: f64,
    memcpy_beside_gbps: Option<f64>,
}

/// Times runs of `op` on a buffer of `bytes` bytes in `rounds` rounds; returns seconds per
/// run of the median round (each round's the slowest rank's, as every rank agrees through a
/// max all-reduce). From [`MEMCPY_FROM`] bytes, each round follows one in which every rank
/// copies as many bytes with memcpy, also reported as the median round.
/// With `shared`, the buffers peers read (all-reduce's, all-gather's input, reduce-scatter's
/// inputs) come from the group; `None` when it offers no such memory.
/// With `in_place`, all-gather's input is its own output's block and reduce-scatter's
/// output its own input's block (nccl-tests' in-place columns).
fn time_op(
    g: &dyn ProcessGroup,
    op: &str,
    bytes: usize,
    shared: bool,
    in_place: bool,
    rounds: usize,
    warmup: usize,
) -> Result<Option<Timing>> {
    let n = g.size();
    let numel = (bytes / 4) as i64;
    let private = |k: i64| Tensor::ones([k], (Kind::Float, Device::Cpu));
    let read_by_peers = |k: i64| -> Result<Option<Tensor>> {
        if !shared {
            return Ok(Some(private(k)));
        }
        Ok(g.alloc(k, Kind::Float, Device::Cpu)?.map(|mut t| t.fill_(1.0)))
    };
    let per = numel / n as i64;
    // The buffer peers read: all of it, or all-gather's input, or every rank's block.
    let read = match op {
        "all_reduce" | "broadcast" => numel,
        "all_gather" if !in_place => per,
        "all_gather" | "reduce_scatter" | "all_to_all" => per * n as i64,
        other => bail!("unknown operation {other:?}"),
    };
    let Some(read) = read_by_peers(read)? else { return Ok(None) };
    let (main, parts): (Tensor, Vec<Tensor>) = match op {
        "all_reduce" | "broadcast" => (read, vec![]),
        "all_gather" if !in_place => (read, (0..n).map(|_| private(per)).collect()),
        // The blocks sent, and a private block to receive each into.
        "all_to_all" => (read, (0..n).map(|_| private(per)).collect()),
        // Blocks of one buffer: all-gather's outputs, or reduce-scatter's inputs.
        _ => {
            let parts = read.chunk(n as i64, 0);
            let own = if op == "all_gather" || in_place { parts[g.rank()].shallow_clone() } else { private(per) };
            (own, parts)
        }
    };
    let run = || -> Result<()> {
        let work = match op {
            "all_reduce" => g.all_reduce(&main, ReduceOp::Sum)?,
            "broadcast" => g.broadcast(&main, 0)?,
            "all_gather" => g.all_gather(&parts, &main)?,
            "all_to_all" => g.all_to_all(&parts, &main.chunk(n as i64, 0))?,
            _ => g.reduce_scatter(&main, &parts, ReduceOp::Sum)?,
        };
        Ok(work.wait()?)
    };
    for _ in 0..warmup {
        run()?;
    }
    // A row moves 1 GiB (3 to 100 runs), so that each round of a 16 MiB row lasts tens of
    // milliseconds, longer than one preemption of a rank on a shared machine.
    let iters = ((1usize << 30) / bytes.max(1)).clamp(3, 100).div_ceil(rounds);
    let mut memcpy = (bytes >= MEMCPY_FROM).then(|| Memcpy::new(bytes));
    let (mut times, mut copies) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..rounds {
        if let Some(m) = memcpy.as_mut() {
            g.barrier()?.wait()?;
            let gbps = m.gbps(iters, false);
            copies.push(all_reduce_values(g, &[gbps], ReduceOp::Min)?[0]);
        }
        g.barrier()?.wait()?;
        let start = Instant::now();
        for _ in 0..iters {
            run()?;
        }
        times.push(all_reduce_values(g, &[start.elapsed().as_secs_f64() / iters as f64], ReduceOp::Max)?[0]);
    }
    let median = crate::bench_runs::median;
    Ok(Some(Timing { seconds: median(times), memcpy_beside_gbps: memcpy.is_some().then(|| median(copies)) }))
}

/// Runs the gloo reference with `n` processes; its rows as (op, bytes) → microseconds.
fn gloo_times(a: &BenchCommArgs, n: usize) -> Result<Vec<(String, usize, f64)>> {
    let args = format!(
        "--nproc {n} --ops {} --min-bytes {} --max-bytes {} --factor {} --warmup {}",
        a.ops, a.min_bytes, a.max_bytes, a.factor, a.warmup
    );
    let args: Vec<String> = args.split_whitespace().map(String::from).collect();
    let report = crate::bench::run_reference(a.python.as_ref(), "torch_comm_reference.py", &args)?;
    let rows = report["rows"].as_array().context("the gloo report has no rows")?;
    rows.iter()
        .map(|r| {
            let op = r["op"].as_str().context("a gloo row without op")?;
            let bytes = r["bytes"].as_u64().context("a gloo row without bytes")?;
            let t = r["time_us"].as_f64().context("a gloo row without time")?;
            Ok((op.to_string(), bytes as usize, t))
        })
        .collect()
}

/// Runs the benchmark, parsed from `command_line`.
pub fn run(a: BenchCommArgs, command_line: &[std::ffi::OsString]) -> Result<()> {
    if let Some(n) = a.nproc {
        return crate::launch::relaunch_self(command_line, n, "--nproc", Some(0));
    }
    if a.min_bytes == 0 || a.factor < 2 || a.min_bytes > a.max_bytes {
        bail!("sizes must satisfy 0 < --min-bytes <= --max-bytes and --factor >= 2");
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let comm = init_from_env("cpu:shm", Duration::from_secs(120)).context("joining the job")?;
    let n = comm.size();
    let all: Vec<usize> = (0..n).collect();
    let mut rows = Vec::new();
    for backend in a.backends.split(',').map(str::trim) {
        let g = comm.new_group_with(&all, &format!("cpu:{backend}"))?.context("this rank is in the world")?;
        let places: &[bool] = if a.in_place { &[false, true] } else { &[false] };
        let variants = a.ops.split(',').map(str::trim).flat_map(|op| {
            let in_place_too = matches!(op, "all_gather" | "reduce_scatter");
            a.buffers
                .split(',')
                .flat_map(move |b| places.iter().filter(move |&&p| !p || in_place_too).map(move |&p| (op, b, p)))
        });
        for (op, buffers, in_place) in variants {
            let mut bytes = a.min_bytes;
            while bytes <= a.max_bytes {
                let shared = match buffers {
                    "private" => false,
                    "shared" => true,
                    other => bail!("unknown buffers {other:?}; expected private or shared"),
                };
                let Some(timing) = time_op(g.as_ref(), op, bytes, shared, in_place, a.rounds, a.warmup)? else {
                    break;
                };
                let t = timing.seconds;
                let algbw = bytes as f64 / t / 1e9;
                rows.push(Row {
                    backend: backend.into(),
                    buffers: buffers.into(),
                    in_place,
                    op: op.into(),
                    bytes,
                    time_us: t * 1e6,
                    algbw_gbps: algbw,
                    busbw_gbps: algbw * bus_factor(op, n),
                    gloo_time_us: None,
                    speedup_vs_gloo: None,
                    memcpy_beside_gbps: timing.memcpy_beside_gbps,
                });
                bytes *= a.factor;
            }
        }
    }
    let first = a.backends.split(',').map(str::trim).next().unwrap_or("shm");
    let g = comm.new_group_with(&all, &format!("cpu:{first}"))?.context("this rank is in the world")?;
    let idle_wait = if n > 1 { Some(idle_wait(&comm, g.as_ref(), first)?) } else { None };
    // Copies are compared at every measured size from MEMCPY_FROM on, or at the largest
    // size when all are smaller.
    let mut memcpy_sizes: Vec<usize> = rows.iter().map(|r| r.bytes).filter(|&b| b >= MEMCPY_FROM).collect();
    memcpy_sizes.sort_unstable();
    memcpy_sizes.dedup();
    if memcpy_sizes.is_empty() {
        memcpy_sizes.extend(rows.iter().map(|r| r.bytes).max());
    }
    let mut streaming_every_rank = Vec::new();
    for &b in &memcpy_sizes {
        g.barrier()?.wait()?;
        let gbps = copy_gbps(b, true);
        streaming_every_rank.push((b, all_reduce_values(g.as_ref(), &[gbps], ReduceOp::Min)?[0]));
    }
    if comm.rank() != 0 {
        return Ok(());
    }
    // The references, measured after the collectives so they do not share the machine.
    let alone =
        |streaming: bool| -> Vec<(usize, f64)> { memcpy_sizes.iter().map(|&b| (b, copy_gbps(b, streaming))).collect() };
    let (memcpy, streaming) = (alone(false), alone(true));
    if !a.no_reference {
        for (op, bytes, t) in gloo_times(&a, n)? {
            for r in rows.iter_mut().filter(|r| r.op == op && r.bytes == bytes) {
                // gloo's buffers are private: the same reference for both kinds of row.
                r.gloo_time_us = Some(t);
                r.speedup_vs_gloo = Some(t / r.time_us);
            }
        }
    }
    let report = Report {
        world_size: n,
        memcpy_gbps: memcpy,
        streaming_copy_gbps: streaming,
        streaming_copy_every_rank_gbps: streaming_every_rank,
        rows,
        idle_wait,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("{n} ranks");
    println!(
        "{:<8} {:<8} {:<24} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10}",
        "backend", "buffers", "op", "bytes", "time us", "algbw GB/s", "busbw GB/s", "gloo us", "vs gloo"
    );
    let or_dash = |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |x| format!("{x:.digits$}"));
    for r in &report.rows {
        println!(
            "{:<8} {:<8} {:<24} {:>12} {:>12.1} {:>12.3} {:>12.3} {:>12} {:>10}",
            r.backend,
            r.buffers,
            format!("{}{}", r.op, if r.in_place { " (in place)" } else { "" }),
            r.bytes,
            r.time_us,
            r.algbw_gbps,
            r.busbw_gbps,
            or_dash(r.gloo_time_us, 1),
            or_dash(r.speedup_vs_gloo, 2)
        );
    }
    for (i, (bytes, alone)) in report.memcpy_gbps.iter().enumerate() {
        let (streamed_alone, streamed) = (report.streaming_copy_gbps[i].1, report.streaming_copy_every_rank_gbps[i].1);
        println!(
            "memcpy {bytes:>10} bytes: {alone:.3} GB/s in one process; streaming copy {streamed_alone:.3} GB/s in one \
             process, {streamed:.3} GB/s per rank with every rank copying"
        );
        for r in report.rows.iter().filter(|r| r.bytes == *bytes) {
            let place = if r.in_place { " in place" } else { "" };
            let beside = r.memcpy_beside_gbps.map_or(String::new(), |m| {
                format!(", {:.2} (every rank, beside the row at {m:.3} GB/s)", r.busbw_gbps / m)
            });
            println!(
                "  {} {} {}{place} busbw / memcpy: {:.2} (one process){beside}; / streaming copy: {:.2} (every rank)",
                r.backend,
                r.buffers,
                r.op,
                r.busbw_gbps / alone,
                r.busbw_gbps / streamed
            );
        }
    }
    if let Some(w) = &report.idle_wait {
        println!(
            "rank 0 computing on {} threads: {:.3} s beside peers blocked in the kernel, {:.3} s beside peers waiting in a {} barrier: slowdown {:.3}",
            w.compute_threads, w.beside_blocked_peers_s, w.beside_waiting_peers_s, w.backend, w.slowdown
        );
    }
    Ok(())
}
