//! A single-process run with checkpoints, interrupted and resumed: a callback stops the
//! first attempt part-way (as a lost job would end), the second continues from the newest
//! checkpoint, and the weights it ends with are those of a run never interrupted.
//!
//! cargo run --release -p strata --example resume [FOLDER]
use std::path::Path;
use strata::data::Batching;
use strata::data::SyntheticCorpus;
use strata::model::{GptConfig, ModelConfig};
use strata::run::{self, Checkpoints, Data, Flow, Model, Outputs, Resume, RunConfig};
use strata::train::StepReport;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scratch = tempfile::tempdir()?;
    let dir = std::env::args().nth(1).map_or(scratch.path().to_path_buf(), Into::into);
    let model = Model::from(ModelConfig::Gpt(GptConfig::new(256, 32, 2, 4, 64)));
    let data = Data::new(SyntheticCorpus::default().generate());
    let config = |name: &str| RunConfig {
        steps: 12,
        threads: Some(1),
        checkpoints: Some(Checkpoints { dir: dir.join(name), every: Some(4), keep: 2, asynchronous: false }),
        outputs: Outputs { weights: Some(dir.join(format!("{name}.safetensors"))), ..Outputs::default() },
        batching: Batching { batch_size: 8, ctx: 32, ..Batching::default() },
        ..RunConfig::default()
    };

    // One run straight through.
    run::train(&model, &data, &config("straight"), &mut [])?;

    // The same run, stopped after step 6 by a callback (a checkpoint is saved as it ends) ...
    let mut stop_at_6 = |r: &StepReport| Ok(if r.step == 6 { Flow::Stop } else { Flow::Continue });
    let first = run::train(&model, &data, &config("resumed"), &mut [&mut stop_at_6])?;
    println!("first attempt stopped after step {}", first.last.map_or(0, |r| r.step));

    // ... and started again: it continues from the newest checkpoint to step 12.
    let again = RunConfig { resume: Some(Resume::Latest), ..config("resumed") };
    let mut steps_run = vec![];
    let mut record = |r: &StepReport| {
        steps_run.push(r.step);
        Ok(Flow::Continue)
    };
    run::train(&model, &data, &again, &mut [&mut record])?;
    println!("resumed run trained steps {steps_run:?}");
    if steps_run != (7..=12).collect::<Vec<_>>() {
        return Err(format!("the resumed run trained steps {steps_run:?}, not 7 to 12").into());
    }
    let gap = largest_difference(&dir.join("straight.safetensors"), &dir.join("resumed.safetensors"))?;
    println!("largest weight difference from the uninterrupted run: {gap:e}");
    if gap != 0.0 {
        return Err("the resumed run's weights differ from the uninterrupted run's".into());
    }
    Ok(())
}

fn largest_difference(a: &Path, b: &Path) -> strata::Result<f64> {
    let (a, b) = (strata::io::read_safetensors(a)?, strata::io::read_safetensors(b)?);
    let mut most = 0.0f64;
    for (name, t) in &a {
        let other = b.get(name).ok_or_else(|| strata::Error::Model(format!("{name} is missing")))?;
        most = most.max((t - other).abs().max().double_value(&[]));
    }
    Ok(most)
}
