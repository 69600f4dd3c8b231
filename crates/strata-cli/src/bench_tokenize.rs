//! `strata bench tokenize`: Strata's streaming tokenization against Hugging Face
//! `tokenizers`' own batch encoding in Python (scripts/tokenize_reference.py), on the same
//! text cut into the same pieces, with the same tokenizer: MiB/s, tokens/s and the ratio, and
//! a check that both wrote the same ids.
use crate::bench::{repo_root, run_reference};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use strata::data::{tokenize_files, TokenData, TokenizeOptions, Tokenizer};
use strata::profile::MIB;

#[derive(Args, Debug)]
pub struct BenchTokenizeArgs {
    /// The text to tokenize (default: ../shared/data/tinyshakespeare.txt beside the checkout).
    #[arg(long)]
    input: Option<PathBuf>,
    /// The text is repeated this many times, to make a large file.
    #[arg(long, default_value_t = 40)]
    repeat: usize,
    /// A tokenizer.json (default: a byte-level BPE trained on the input by the reference).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Vocabulary of the trained BPE.
    #[arg(long, default_value_t = 8192)]
    vocab: usize,
    /// Rounds of each side; the best of each is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Python of the environment with tokenizers (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Side {
    name: &'static str,
    seconds: f64,
    mib_per_s: f64,
    tokens_per_s: f64,
}

pub fn run(args: BenchTokenizeArgs) -> Result<()> {
    let input = args.input.clone().unwrap_or_else(|| repo_root().join("../shared/data/tinyshakespeare.txt"));
    let text = std::fs::read(&input).with_context(|| format!("cannot read {}", input.display()))?;
    if args.rounds == 0 || args.repeat == 0 {
        bail!("--rounds and --repeat must be positive");
    }
    let dir = tempfile::tempdir()?;
    let large = dir.path().join("large.txt");
    let mut f = std::fs::File::create(&large)?;
    for _ in 0..args.repeat {
        f.write_all(&text)?;
    }
    drop(f);
    let bytes = (text.len() * args.repeat) as f64;
    let python = args.python.as_ref();
    let tokenizer_path = match &args.tokenizer {
        Some(p) => p.clone(),
        None => {
            let path = dir.path().join("tokenizer.json");
            let s = |p: &std::path::Path| p.display().to_string();
            run_reference(
                python,
                "tokenize_reference.py",
                &[
                    "make-tokenizer".into(),
                    "--text".into(),
                    s(&input),
                    "--vocab".into(),
                    args.vocab.to_string(),
                    "--out".into(),
                    s(&path),
                ],
            )?;
            path
        }
    };
    let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
    let options = TokenizeOptions::default();
    let ours_path = dir.path().join("ours.tok");
    let theirs_path = dir.path().join("theirs.bin");
    let (mut ours, mut theirs) = (f64::INFINITY, f64::INFINITY);
    let mut tokens = 0;
    for _ in 0..args.rounds {
        let report = tokenize_files(std::slice::from_ref(&large), &tokenizer, &ours_path, &options, &mut |_, _| {})?;
        ours = ours.min(report.seconds);
        tokens = report.tokens;
        let reference = run_reference(
            python,
            "tokenize_reference.py",
            &[
                "encode".into(),
                "--tokenizer".into(),
                tokenizer_path.display().to_string(),
                "--input".into(),
                large.display().to_string(),
                "--piece-bytes".into(),
                options.piece_bytes.to_string(),
                "--batch-pieces".into(),
                options.batch_pieces.to_string(),
                "--out".into(),
                theirs_path.display().to_string(),
            ],
        )?;
        theirs = theirs.min(reference["seconds"].as_f64().context("the reference's seconds")?);
    }
    let written = TokenData::open(&ours_path, None)?.to_vec();
    let expected: Vec<u32> =
        std::fs::read(&theirs_path)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if written != expected {
        bail!("Strata wrote {} ids, tokenizers {}: they differ", written.len(), expected.len());
    }
    let side = |name, seconds: f64| Side {
        name,
        seconds,
        mib_per_s: bytes / seconds / MIB,
        tokens_per_s: tokens as f64 / seconds,
    };
    let rows = [side("strata tokenize", ours), side("tokenizers encode_batch (Python)", theirs)];
    let ratio = theirs / ours;
    if args.json {
        let report =
            serde_json::json!({"bytes": bytes, "tokens": tokens, "rows": rows, "ratio": ratio, "same_ids": true});
        println!("{report}");
        return Ok(());
    }
    println!("{:.1} MiB of text, {tokens} tokens, same ids on both sides", bytes / MIB);
    println!("| tokenizer | seconds | MiB/s | tokens/s |");
    println!("|---|---|---|---|");
    for r in &rows {
        println!("| {} | {:.2} | {:.1} | {:.0} |", r.name, r.seconds, r.mib_per_s, r.tokens_per_s);
    }
    println!("strata / tokenizers: {ratio:.2}x");
    Ok(())
}
