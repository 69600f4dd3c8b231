//! `strata bench generate`: batched decoding with the key/value cache against `transformers`'
//! `generate` (scripts/hf_reference.py, its default attention) on the same random LLaMA
//! folder and the same prompts, greedy: tokens/s of each, the ratio, Strata one prompt at a
//! time beside them, and how many rows both decoded alike.
use crate::bench::run_reference;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;
use strata::engine::{Engine, EngineConfig};
use strata::generate::{generate, generate_batch, GenerateConfig};
use strata::io::load_model_dir;
use strata::model::from_pretrained_dir;

#[derive(Args, Debug)]
pub struct BenchGenerateArgs {
    /// Prompts decoded together.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens of each prompt (of the longest, with --mixed-lengths).
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// Prompts of several lengths, from half of --prompt-tokens up: both sides pad the
    /// shorter ones on the left and mask their padding.
    #[arg(long)]
    mixed_lengths: bool,
    /// Tokens generated after each prompt.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Rounds of each side; the best of each is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Compute threads of both sides (default: libtorch's choice).
    #[arg(long)]
    threads: Option<i32>,
    /// Python of the environment with transformers (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Side {
    name: &'static str,
    seconds: f64,
    tokens_per_s: f64,
}

/// The best time of `rounds` runs of `f`, and what its last run gave.
fn best_of<T>(rounds: usize, mut f: impl FnMut() -> Result<T>) -> Result<(f64, T)> {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..rounds {
        let start = Instant::now();
        out = Some(f()?);
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok((best, out.context("no round ran")?))
}

pub fn run(args: BenchGenerateArgs) -> Result<()> {
    if args.rounds == 0 || args.batch == 0 || args.prompt_tokens == 0 || args.new_tokens == 0 {
        bail!("--rounds, --batch, --prompt-tokens and --new-tokens must be positive");
    }
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let dir = tempfile::tempdir()?;
    let folder_path = dir.path().join("llama");
    let s = |p: &std::path::Path| p.display().to_string();
    let python = args.python.as_ref();
    run_reference(
        python,
        "hf_reference.py",
        &["make".into(), "--family".into(), "llama-bench".into(), "--out".into(), s(&folder_path)],
    )?;
    let folder = from_pretrained_dir(&folder_path)?;
    let context = folder.config.context();
    if context.is_some_and(|c| (args.prompt_tokens + args.new_tokens) as i64 > c) {
        bail!("--prompt-tokens plus --new-tokens pass the model's context of {context:?}");
    }
    let mut engine = Engine::new(folder.spec()?, EngineConfig::default())?;
    load_model_dir(&mut engine, &folder)?;
    // Prompts drawn from the tokenizer's words (ids 3 onwards), the same on both sides.
    let vocab = folder.config.vocab().min(90) - 3;
    let shortest = args.prompt_tokens.div_ceil(2);
    let length = |r: usize| match args.mixed_lengths {
        true => args.prompt_tokens - (r * 7) % (args.prompt_tokens - shortest + 1),
        false => args.prompt_tokens,
    };
    let prompts: Vec<Vec<i64>> = (0..args.batch)
        .map(|r| (0..length(r)).map(|i| 3 + ((r * 31 + i * 17 + r * i) as i64 % vocab)).collect())
        .collect();
    let config = GenerateConfig { max_new_tokens: args.new_tokens, ..Default::default() };
    let (batched, ours) = best_of(args.rounds, || Ok(generate_batch(&mut engine, None, &prompts, &config, context)?))?;
    let (alone, _) = best_of(args.rounds, || {
        prompts.iter().map(|p| Ok(generate(&mut engine, p, &config, context)?)).collect::<Result<Vec<_>>>()
    })?;
    let mut reference_args = vec![
        "generate-bench".into(),
        "--dir".into(),
        s(&folder_path),
        "--prompts".into(),
        serde_json::to_string(&prompts)?,
        "--max-new-tokens".into(),
        args.new_tokens.to_string(),
        "--rounds".into(),
        args.rounds.to_string(),
    ];
    if let Some(t) = args.threads {
        reference_args.extend(["--threads".into(), t.to_string()]);
    }
    let reference = run_reference(python, "hf_reference.py", &reference_args)?;
    let theirs_seconds = reference["seconds"].as_f64().context("the reference's seconds")?;
    let theirs: Vec<Vec<i64>> = serde_json::from_value(reference["tokens"].clone())?;
    let same_rows = ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
    let tokens = (args.batch * args.new_tokens) as f64;
    let side = |name, seconds: f64| Side { name, seconds, tokens_per_s: tokens / seconds };
    let rows = [
        side("strata generate_batch", batched),
        side("transformers generate (batch)", theirs_seconds),
        side("strata generate, one prompt at a time", alone),
    ];
    let ratio = theirs_seconds / batched;
    if args.json {
        let report = serde_json::json!({
            "batch": args.batch, "prompt_tokens": args.prompt_tokens, "mixed_lengths": args.mixed_lengths,
            "new_tokens": args.new_tokens,
            "rows": rows, "ratio": ratio, "same_rows": same_rows,
        });
        println!("{report}");
        return Ok(());
    }
    let lengths = if args.mixed_lengths {
        format!("{shortest} to {}", args.prompt_tokens)
    } else {
        args.prompt_tokens.to_string()
    };
    println!(
        "LLaMA (256 wide, 4 layers), {} prompts of {lengths} tokens, {} new tokens each, greedy; {same_rows} of {} rows \
         decoded alike",
        args.batch, args.new_tokens, args.batch
    );
    println!("| side | seconds | tokens/s |");
    println!("|---|---|---|");
    for r in &rows {
        println!("| {} | {:.3} | {:.0} |", r.name, r.seconds, r.tokens_per_s);
    }
    println!("strata / transformers: {ratio:.2}x");
    Ok(())
}
