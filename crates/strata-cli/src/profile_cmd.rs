//! `strata profile trace|summary|plot DIR`: a recorded profile (`strata train --profile DIR`)
//! as a Chrome trace, a summary table or pictures; `strata plot METRICS...`: training
//! metrics drawn. The library does the reading and the work.
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use strata::profile::plot::{self, metrics, ImageFormat};
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
    /// Draw memory over time (with forward, backward and update bands), the map of where
    /// each unit's parameters are over time, and per-unit time and memory bars.
    Plot {
        dir: PathBuf,
        /// Folder for the pictures (default: the profile folder).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// png or svg.
        #[arg(long, default_value = "png")]
        format: String,
        /// TrueType font for the labels (default: a system font found in the usual places).
        #[arg(long)]
        font: Option<PathBuf>,
    },
}

#[derive(Args)]
pub struct PlotArgs {
    /// Metrics files (JSON lines of `strata train --metrics`), one run each.
    #[arg(required = true)]
    metrics: Vec<PathBuf>,
    /// The picture to write (.png or .svg).
    #[arg(short, long)]
    output: PathBuf,
    /// TrueType font for the labels (default: a system font found in the usual places).
    #[arg(long)]
    font: Option<PathBuf>,
}

fn use_font(font: Option<&Path>) -> Result<()> {
    if let Some(f) = font {
        plot::use_font(f)?;
    }
    Ok(())
}

pub fn plot_metrics(a: PlotArgs) -> Result<()> {
    use_font(a.font.as_deref())?;
    let runs = a
        .metrics
        .iter()
        .map(|path| {
            let name = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into());
            Ok((name, metrics::read(path)?))
        })
        .collect::<Result<Vec<_>>>()?;
    plot::render(&metrics::MetricsPlot(&runs), &a.output)?;
    println!("wrote {} ({} runs)", a.output.display(), runs.len());
    Ok(())
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
        ProfileCommand::Plot { dir, output, format, font } => {
            use_font(font.as_deref())?;
            let format = ImageFormat::of(Path::new(&format!("picture.{format}")))?;
            let profiles = profile::read_dir(&dir)?;
            for path in plot::profile_pictures(&profiles, output.as_ref().unwrap_or(&dir), format)? {
                println!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}
