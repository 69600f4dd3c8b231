//! `strata bench offload`: for a device and a host budget, the largest GPT (in layers of a
//! given width) that trains under each placement — everything on the device, optimizer
//! state on the host, everything on the host (static), and the planner's `auto` — with its
//! tokens/s, the bytes moved per step and the share of the step spent waiting for copies;
//! `auto` also without prefetch, and the optimizer on the host also with its update delayed
//! (run during the next step), at the same sizes, to show what each hides. Every
//! placement recomputes its blocks (unless `--no-checkpoint`), as offloaded training does,
//! so activations do not crowd the model states out of the device.
use crate::bench_runs;
use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use strata::model::{GptConfig, ModelConfig};
use strata::profile::MIB;

#[derive(Args, Debug, Clone)]
pub struct BenchOffloadArgs {
    /// Bytes the device may hold.
    #[arg(long, default_value_t = 256 << 20)]
    device_memory: u64,
    /// Bytes of host memory for model states.
    #[arg(long, default_value_t = 4 << 30)]
    host_memory: u64,
    #[arg(long, default_value_t = 8)]
    heads: i64,
    #[arg(long, default_value_t = 512)]
    dim: i64,
    #[arg(long, default_value_t = 64)]
    ctx: i64,
    #[arg(long, default_value_t = 2)]
    batch_size: usize,
    /// Steps of each timed run at each placement's largest size (the first is warm-up).
    #[arg(long, default_value_t = 4)]
    steps: u64,
    /// Timed runs per placement, in rounds that visit every placement in turn (so drifts of
    /// a shared machine fall on all alike); the figures are their steps' medians.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Most layers tried.
    #[arg(long, default_value_t = 256)]
    max_layers: i64,
    /// Keep every block's activations instead of recomputing them.
    #[arg(long)]
    no_checkpoint: bool,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    placement: &'static str,
    strategy: String,
    /// The most layers that train within the budgets (0: none).
    layers: i64,
    params: i64,
    /// Parameters over static full offload's.
    vs_static_full: f64,
    tokens_per_s: f64,
    /// Bytes copied between device and host per step, both ways (median of the timed steps).
    moved_per_step: f64,
    /// Seconds waiting for copies over the step's seconds.
    copy_wait_share: f64,
    /// Tokens/s over those of the placement it runs the size of (prefetch off, update
    /// delayed), measured in the same rounds; absent where it trains no model that large.
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_same_size: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    device_memory: u64,
    host_memory: u64,
    /// (device + host) / 16 bytes per parameter: fp32 parameters, gradients and Adam's moments.
    bound_params: f64,
    rows: Vec<Row>,
}

/// Each placement's `offload` method (none: no offload), and the placement whose largest
/// size it runs at (none: its own). Prefetch and delaying the update change no placement:
/// at the same size they show what they hide.
const PLACEMENTS: [(&str, Option<&str>, Option<&str>); 6] = [
    ("none", None, None),
    ("optimizer", Some(r#"["offload", {"params": "none", "optimizer": "cpu", "policy": "static"}]"#), None),
    (
        "optimizer-delayed",
        Some(r#"["offload", {"params": "none", "optimizer": "cpu", "policy": "static", "delayed_update": true}]"#),
        Some("optimizer"),
    ),
    ("static-full", Some(r#"["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]"#), None),
    ("auto", Some(r#""offload""#), None),
    ("auto-no-prefetch", Some(r#"["offload", {"prefetch": 0}]"#), Some("auto")),
];

/// The strategy of a placement: its offload method, after recomputation unless left out.
fn strategy(args: &BenchOffloadArgs, offload: Option<&str>) -> String {
    let checkpoint = (!args.no_checkpoint).then_some(r#"["checkpoint", ["GptBlock"]]"#);
    let methods: Vec<&str> = checkpoint.into_iter().chain(offload).collect();
    format!("[{}]", methods.join(", "))
}

fn flags(args: &BenchOffloadArgs, layers: i64, steps: u64, strategy: &str) -> Vec<String> {
    let text = format!(
        "--model gpt --vocab 256 --schedule constant --threads 1 --layers {layers} --heads {} --dim {} --ctx {} --batch-size {} --steps {steps} --device-memory {} --host-memory {}",
        args.heads, args.dim, args.ctx, args.batch_size, args.device_memory, args.host_memory
    );
    let mut argv: Vec<String> = text.split_whitespace().map(String::from).collect();
    argv.extend(["--strategy".to_string(), strategy.to_string()]);
    argv
}

/// Whether a GPT of `layers` layers trains a step under `strategy` within the budgets;
/// failures other than running out of a budget are errors.
fn fits(args: &BenchOffloadArgs, layers: i64, strategy: &str) -> Result<bool> {
    match bench_runs::train(&flags(args, layers, 1, strategy), 0) {
        Ok(_) => Ok(true),
        Err(e) if ["out of memory", "do not fit"].iter().any(|m| e.to_string().contains(m)) => Ok(false),
        Err(e) => Err(e),
    }
}

pub fn run(args: BenchOffloadArgs) -> Result<()> {
    if args.steps < 2 {
        bail!("--steps must be at least 2 (one warm-up, one timed)");
    }
    let params_of = |layers: i64| -> Result<i64> {
        if layers == 0 {
            return Ok(0);
        }
        Ok(ModelConfig::Gpt(GptConfig::new(256, args.ctx, layers, args.heads, args.dim)).spec()?.num_params())
    };
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let mut rows: Vec<Row> = Vec::new();
    for (placement, offload, sized_like) in PLACEMENTS {
        let strategy = strategy(&args, offload);
        // A row run at another's size takes it where it fits there (a delayed update's
        // gradient twins may not fit the host), else its own largest below it.
        let most = match sized_like {
            Some(other) => rows.iter().find(|r| r.placement == other).map_or(0, |r| r.layers),
            None => args.max_layers,
        };
        let layers = match sized_like {
            Some(_) if most > 0 && fits(&args, most, &strategy)? => most,
            // Searched from the size the placement before this one reached (each moves more off
            // the device than the one before).
            _ => bench_runs::largest_fitting(rows.last().map_or(1, |r| r.layers), most, |layers| {
                fits(&args, layers, &strategy)
            })?,
        };
        let params = params_of(layers)?;
        rows.push(Row {
            placement,
            strategy,
            layers,
            params,
            vs_static_full: 0.0,
            tokens_per_s: 0.0,
            moved_per_step: 0.0,
            copy_wait_share: 0.0,
            vs_same_size: None,
        });
    }
    // Per placement, every timed step's tokens/s, bytes moved and copy-wait share.
    let mut samples: Vec<[Vec<f64>; 3]> = rows.iter().map(|_| Default::default()).collect();
    for _ in 0..args.rounds {
        for (row, sample) in rows.iter().zip(&mut samples).filter(|(r, _)| r.layers > 0) {
            let run = bench_runs::train(&flags(&args, row.layers, args.steps, &row.strategy), 1)?;
            for r in &run.timed {
                let t = &r["transfers"];
                let seconds = r["seconds"].as_f64().unwrap_or(1.0).max(1e-9);
                sample[0].push(r["tokens_per_s"].as_f64().unwrap_or(0.0));
                sample[1].push(t["to_device"].as_f64().unwrap_or(0.0) + t["to_host"].as_f64().unwrap_or(0.0));
                sample[2].push(t["wait_s"].as_f64().unwrap_or(0.0) / seconds);
            }
        }
    }
    for (row, [speeds, moved, waits]) in rows.iter_mut().zip(samples) {
        row.tokens_per_s = bench_runs::median(speeds);
        row.moved_per_step = bench_runs::median(moved);
        row.copy_wait_share = bench_runs::median(waits);
    }
    for (i, (_, _, sized_like)) in PLACEMENTS.iter().enumerate() {
        let reference = sized_like.and_then(|other| rows.iter().find(|r| r.placement == other));
        let reference = reference.filter(|r| r.layers == rows[i].layers);
        if let Some(speed) = reference.map(|r| r.tokens_per_s).filter(|&s| s > 0.0) {
            rows[i].vs_same_size = Some(rows[i].tokens_per_s / speed);
        }
    }
    let full = rows.iter().find(|r| r.placement == "static-full").map_or(0, |r| r.params).max(1) as f64;
    for r in &mut rows {
        r.vs_static_full = r.params as f64 / full;
    }
    let report = Report {
        device_memory: args.device_memory,
        host_memory: args.host_memory,
        bound_params: (args.device_memory + args.host_memory) as f64 / 16.0,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "device {:.0} MiB, host {:.0} MiB: bound (device + host) / 16 B = {:.1}M parameters (GPT, width {})",
        args.device_memory as f64 / (1 << 20) as f64,
        args.host_memory as f64 / (1 << 20) as f64,
        report.bound_params / 1e6,
        args.dim
    );
    println!(
        "{:<17} {:>6} {:>10} {:>8} {:>9} {:>10} {:>10} {:>9} {:>9}",
        "placement", "layers", "params", "/bound", "/static", "tokens/s", "MiB moved", "copy-wait", "/same size"
    );
    for r in &report.rows {
        println!(
            "{:<17} {:>6} {:>9.1}M {:>8.3} {:>9.2} {:>10.0} {:>10.1} {:>8.1}% {:>9}",
            r.placement,
            r.layers,
            r.params as f64 / 1e6,
            r.params as f64 / report.bound_params,
            r.vs_static_full,
            r.tokens_per_s,
            r.moved_per_step / MIB,
            100.0 * r.copy_wait_share,
            r.vs_same_size.map_or(String::new(), |v| format!("{v:.2}"))
        );
    }
    Ok(())
}
