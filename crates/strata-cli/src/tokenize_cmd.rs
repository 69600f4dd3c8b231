//! `strata tokenize`: text files into one token file for `--token-file`, streaming, over
//! every core, with a progress bar. The work is the library's (`strata::data::tokenize_files`).
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use strata::data::{tokenize_files, TokenWidth, TokenizeOptions};

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// UTF-8 text files, tokenized in order into one token file.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The token file to write.
    #[arg(long, short)]
    output: PathBuf,
    /// A Hugging Face tokenizer.json (default: --model-dir's, else one token per byte).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The model folder the tokens are for: its tokenizer, and a width its vocabulary fits.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Width of the ids (default: u16 where the vocabulary fits it, else u32).
    #[arg(long)]
    width: Option<TokenWidth>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let folder = args.model_dir.as_deref().map(strata::model::from_pretrained_dir).transpose()?;
    let tokenizer = crate::options::tokenizer(args.tokenizer.as_deref(), folder.as_ref())?;
    let vocab = folder.as_ref().map_or(0, |f| f.config.vocab() as u64).max(tokenizer.vocab_size() as u64);
    let options =
        TokenizeOptions { width: Some(args.width.unwrap_or(TokenWidth::for_vocab(vocab))), ..Default::default() };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .context("the progress bar's template")?,
    );
    let report = tokenize_files(&args.inputs, &tokenizer, &args.output, &options, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} tokens ({}) from {} bytes in {:.1} s ({:.1} MiB/s) into {}",
            report.tokens,
            report.width.name(),
            report.bytes,
            report.seconds,
            report.bytes as f64 / report.seconds.max(1e-9) / strata::profile::MIB,
            args.output.display()
        );
    }
    Ok(())
}
