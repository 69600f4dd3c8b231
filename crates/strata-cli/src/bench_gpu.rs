//! `strata bench gpu`: `strata bench train` on one GPU for the two models a user moving to a
//! GPU would try first, in bf16 autocast with fused attention: GPT-2 small (124M) and a
//! LLaMA of 1.1B parameters, the latter also with fp8 linears.
use crate::bench::{self, Amp, BenchModel, BenchTrainArgs, Report};
use crate::bench_runs::GptShape;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct BenchGpuArgs {
    /// The GPU: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Sequences per step of GPT-2 (1024 tokens each).
    #[arg(long, default_value_t = 16)]
    gpt_batch_size: i64,
    /// Sequences per step of the LLaMA (2048 tokens each); the default leaves room on an
    /// 80 GB GPU for its three sides (PyTorch, Strata bf16 and Strata fp8) at once.
    #[arg(long, default_value_t = 2)]
    llama_batch_size: i64,
    /// Leave out the fp8 side of the LLaMA.
    #[arg(long)]
    no_fp8: bool,
    /// Dense bf16 peak of the GPU in TFLOP/s (default: known from its name).
    #[arg(long)]
    peak_tflops: Option<f64>,
    #[arg(long, default_value_t = 6)]
    rounds: u64,
    #[arg(long, default_value_t = 5)]
    block: u64,
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// Python of the environment with torch (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

impl BenchGpuArgs {
    fn train_args(&self, model: BenchModel) -> BenchTrainArgs {
        let (shape, vocab, batch_size, kv_heads, ffn_dim, fp8) = match model {
            // GPT-2 small, its vocabulary padded to a multiple of 64.
            BenchModel::Gpt => {
                (GptShape { layers: 12, heads: 12, dim: 768, ctx: 1024 }, 50304, self.gpt_batch_size, None, None, false)
            }
            // TinyLlama's shape (1.1B): 22 blocks of width 2048, head size 128, 4 key/value
            // heads, LLaMA-2's vocabulary.
            BenchModel::Llama => (
                GptShape { layers: 22, heads: 16, dim: 2048, ctx: 2048 },
                32000,
                self.llama_batch_size,
                Some(4),
                Some(5632),
                !self.no_fp8,
            ),
        };
        BenchTrainArgs {
            shape,
            model,
            kv_heads,
            ffn_dim,
            vocab,
            batch_size,
            threads: 4,
            device: self.device.clone(),
            amp: Amp::Bf16,
            fp8,
            peak_tflops: self.peak_tflops,
            rounds: self.rounds,
            block: self.block,
            warmup: self.warmup,
            python: self.python.clone(),
            json: self.json,
        }
    }
}

pub fn run(a: BenchGpuArgs) -> Result<()> {
    let mut reports: Vec<Report> = Vec::new();
    for model in [BenchModel::Gpt, BenchModel::Llama] {
        let report = bench::measure(&a.train_args(model))?;
        if !a.json {
            bench::print(&report, a.block);
            println!();
        }
        reports.push(report);
    }
    let json = serde_json::to_string_pretty(&reports)?;
    if a.json {
        println!("{json}");
    }
    if let Some(path) = &a.json_out {
        std::fs::write(path, json + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
