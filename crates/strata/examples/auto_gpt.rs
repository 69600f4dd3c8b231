//! `auto_accelerate` in fully automatic mode: the strategy for a small GPT is searched by
//! dry runs, then the prepared run trains.
//!
//! cargo run --release -p strata --example auto_gpt
use std::sync::Arc;
use strata::auto::{auto_accelerate, AutoAccelerate, DataloaderArgs};
use strata::data::{Order, SyntheticCorpus};
use strata::model::{self, Builder, GptConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpt = |b: &mut Builder| model::gpt(&GptConfig::new(256, 64, 2, 4, 128), b);
    let data = Arc::new(SyntheticCorpus::default().generate());
    let args = DataloaderArgs { ctx: 64, batch_size: 16, accumulation: 1, seed: 0, order: Order::Shuffled };
    let out = auto_accelerate(AutoAccelerate::new(&gpt, data, args));
    let Some(mut run) = out.result.filter(|_| out.status) else {
        return Err(out.reason.unwrap_or_default().into());
    };
    eprint!("{}", out.report.table());
    if let Some(strategy) = &out.best_strategy {
        eprintln!("strategy: {}", strategy.to_value());
    }
    for step in run.loader.by_ref().take(100) {
        let report = run.trainer.train_step(&step?)?;
        if report.step % 20 == 0 {
            println!("step {} loss {:.4} ({:.0} tokens/s)", report.step, report.loss, report.tokens_per_s);
        }
    }
    Ok(())
}
