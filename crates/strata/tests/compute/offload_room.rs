//! The room beside model states that offload's plan leaves, measured by libtorch's
//! allocator: what one warm-up step predicts is what every step of a long run holds, and a
//! budget just above the plan's need lasts. Alone in its test binary, so the allocator's
//! process-wide counts see this run and nothing else.

use crate::common::tied_gpt::{model_state_bytes, spec, step, trainer};
use std::sync::Arc;
use strata::engine::offload::{NonModelTrace, Offload, OffloadOptions};
use strata::engine::EngineConfig;
use strata::parallel::{measure_non_model, RankLayout};
use strata::strategy::Strategy;
use strata::train::Feed;

#[test]
fn the_room_predicted_from_one_step_is_what_200_steps_hold_and_a_tight_budget_lasts() {
    let _serial = crate::serial();
    strata_ext::cpu_memory::track().unwrap();
    let strategy = Strategy::parse(r#"["offload"]"#).unwrap();
    let unlimited = EngineConfig::default();
    let predicted =
        measure_non_model(spec(), unlimited.clone(), &strategy, &RankLayout::single(), &step(0), &Feed::default())
            .unwrap();
    // Activations and temporaries, far beyond what the ledger alone counts.
    let largest = predicted.iter().copied().max().unwrap();
    assert!(largest > model_state_bytes() / 4, "the allocator's figure: {predicted:?}");
    let options = OffloadOptions {
        policy: strategy.offload().unwrap().home_policy().unwrap(),
        optimizer_bytes_per_element: 8,
        prefetch: 2,
        pin_memory: false,
        non_model: Some(predicted.clone()),
        on_host: vec![],
        slot_bytes: None,
        delayed_update: false,
    };
    // The budget: what the plan needs with room for 40% of the model states beside the
    // largest moment's, plus 5%.
    let tight = EngineConfig { device_budget: Some(model_state_bytes() * 4 / 10 + largest), ..unlimited };
    let need = Offload::plan_for(&spec(), &tight, &options).unwrap().device_peak();
    let budget = need + need / 20;
    let config = EngineConfig { device_budget: Some(budget), ..tight };
    let at = RankLayout { non_model: Some(predicted.clone()), ..RankLayout::single() };
    let mut trainer = trainer(&strategy, &config, &at).unwrap();
    let trace = Arc::new(NonModelTrace::new(trainer.engine()));
    trainer.engine_mut().set_event_sink(trace.clone());
    for i in 0..200 {
        trainer.train_step(&step(i % 20)).unwrap();
    }
    // At every moment, the most any step held beside model states is the prediction,
    // within 5% (a floor of 1 MiB, which serves large models, would pass anything here).
    let measured = trace.peaks();
    for (moment, (&got, &want)) in measured.iter().zip(&predicted).enumerate() {
        let allowed = want / 20;
        assert!(got.abs_diff(want) <= allowed, "moment {moment}: measured {got}, predicted {want}");
    }
    // The allocator's device bytes (beside model states, plus the states the ledger placed
    // on the device) stayed within the budget at every moment of every step.
    let peak = trace.device_peak();
    eprintln!("device peak {peak} of a budget of {budget}; room predicted {predicted:?}, measured {measured:?}");
    assert!(peak <= budget, "the device's peak {peak} over its budget {budget}");
}
