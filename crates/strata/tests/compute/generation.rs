//! What decoding holds, measured on the CPU allocator, against the memory estimate's
//! generation term.

use strata::auto::candidate::{Candidate, Layout, Precision, Sharding};
use strata::auto::estimate::{self, Generation, Machine, Workload};
use strata::engine::{Engine, EngineConfig};
use strata::generate::{generate_batch, GenerateConfig};
use strata::model::{GptConfig, ModelConfig};

/// The memory estimate's generation term against the allocator: decoding 64 rows of a GPT
/// for 60 positions peaks within a tenth of what `auto::estimate::with_generation` counts.
#[test]
fn the_generation_estimate_meets_the_allocator() {
    let _serial = crate::serial();
    let config = ModelConfig::Gpt(GptConfig::new(512, 64, 4, 4, 128));
    let mut engine = Engine::new(config.spec().unwrap(), EngineConfig::default()).unwrap();
    let layout = Layout::new(Candidate::plain(Precision::Fp32, Sharding::None, false));
    let machine =
        Machine { device: estimate::device_kind("cpu").unwrap(), device_bytes: u64::MAX, host_bytes: u64::MAX };
    let work = Workload { ranks: 1, micro_batch: 1, ctx: 1, micro_batches: 1, optimizer_state_bytes: 0 };
    let base = estimate::estimate(&config, &layout, &work, &machine).unwrap();
    let g = Generation { rows: 64, positions: 60, reference_copy: false };
    let counted = estimate::with_generation(base, &config, &layout, &g, &machine).unwrap().device.activations;
    strata_ext::cpu_memory::track().unwrap();
    let prompts = vec![vec![5i64, 6, 7, 8]; 64];
    let before = strata_ext::cpu_memory::stats().unwrap().0;
    strata_ext::cpu_memory::reset_peak().unwrap();
    let config = GenerateConfig { max_new_tokens: 56, ..Default::default() };
    generate_batch(&mut engine, None, &prompts, &config, Some(64)).unwrap();
    let peak = (strata_ext::cpu_memory::stats().unwrap().1 - before) as f64;
    eprintln!("decoding peaked at {peak} bytes; the estimate counts {counted}");
    assert!((peak / counted as f64 - 1.0).abs() < 0.1, "peak {peak} against {counted}");
}
