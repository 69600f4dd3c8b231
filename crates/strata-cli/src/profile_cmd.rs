//! `strata profile trace|summary DIR`: a recorded profile (`strata train --profile DIR`) as a
//! Chrome trace or a summary table; the library does the reading and the work.
use anyhow::{Context, Result};
use clap::Subcommand;
use std::path::PathBuf;
use strata::profile::{self, summary, trace};

#[derive(Subcommand)]
pub enum ProfileCommand {
    /// Write a Chrome trace / Perfetto JSON of the profile (a track group per rank).
    Trace {
        /// The profile folder (`--profile` of `strata train`).
        dir: PathBuf,
        /// The trace file to write.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Print each rank's slowest units, memory peaks, copies and update time.
    Summary {
        dir: PathBuf,
        /// Units listed per rank.
        #[arg(long, default_value_t = 10)]
        top: usize,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: ProfileCommand) -> Result<()> {
    match command {
        ProfileCommand::Trace { dir, output } => {
            let profiles = profile::read_dir(&dir)?;
            let text = serde_json::to_vec(&trace::chrome_trace(&profiles))?;
            strata::io::write_atomic(&output, &text).with_context(|| format!("writing {}", output.display()))?;
            println!("wrote {} ({} ranks)", output.display(), profiles.len());
        }
        ProfileCommand::Summary { dir, top, json } => {
            let summaries = summary::summarize(&profile::read_dir(&dir)?);
            if json {
                println!("{}", serde_json::to_string_pretty(&summaries)?);
            } else {
                print!("{}", summary::table(&summaries, top));
            }
        }
    }
    Ok(())
}
