//! The reference pages against the code, both ways: docs/metrics.md names every field a
//! step's metrics object holds (a report with every optional part present, flattened into
//! paths), docs/strategies.md every method and every option of each method's
//! configuration, and neither names one the code lacks.
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use strata::checkpoint::snapshot::SaveTimes;
use strata::engine::memory::{PlacementReport, Transfers};
use strata::engine::{Category, Placement, UnitTime};
use strata::grpo::GrpoMetrics;
use strata::model::BalanceReport;
use strata::preference::PreferenceMetrics;
use strata::reward::RewardMetrics;
use strata::train::{PipelineFigures, StepReport};

/// A report whose every optional field is filled (a new field must be given here, so it
/// reaches the comparison).
fn full_report() -> StepReport {
    let categories = [Category::Params, Category::Grads, Category::OptimizerState, Category::Activations];
    let placement = PlacementReport { current: 1, peak: 2, by_category: categories.map(|c| (c, 1)).into(), pinned: 0 };
    StepReport {
        step: 1,
        loss: 1.0,
        supervised_tokens: 1,
        lr: 1.0,
        grad_norm: Some(1.0),
        tokens: 1,
        seconds: 1.0,
        tokens_per_s: 1.0,
        peak_bytes: 1,
        loss_scale: Some(1.0),
        skipped: false,
        allocator_peak_bytes: Some(1),
        model_state_peak_bytes: 1,
        memory: BTreeMap::from([(Placement::Device, placement.clone()), (Placement::Host, placement)]),
        rss_peak_bytes: Some(1),
        comm_wait_s: 0.0,
        transfers: Transfers::default(),
        unit_times: Some(vec![UnitTime { kept_bytes: Some(1), ..UnitTime::default() }]),
        pipeline: Some(PipelineFigures {
            bubble: vec![0.0],
            micro_batches_held: vec![1],
            activation_peak_bytes: vec![1],
            outputs_freed: vec![0],
            mean_op_seconds: vec![[0.0; 3]],
        }),
        experts: Some(BalanceReport {
            aux_loss: 1.0,
            min_expert_tokens: 1,
            max_expert_tokens: 1,
            remote_expert_tokens: 0,
            dropped_expert_tokens: 0,
            z_loss: 0.0,
        }),
        preference: Some(PreferenceMetrics {
            rewards_chosen: 1.0,
            rewards_rejected: 1.0,
            rewards_accuracies: Some(1.0),
            rewards_margins: 1.0,
            logps_chosen: 1.0,
            logps_rejected: 1.0,
            logits_chosen: 1.0,
            logits_rejected: 1.0,
            entropy: 1.0,
            mean_token_accuracy: Some(1.0),
            kl: Some(1.0),
            nll_loss: Some(1.0),
            log_odds_ratio: Some(1.0),
            log_odds_chosen: Some(1.0),
        }),
        reward: Some(RewardMetrics { accuracy: 1.0, margin: 1.0, min_reward: 1.0, mean_reward: 1.0, max_reward: 1.0 }),
        grpo: Some(GrpoMetrics {
            kl: Some(1.0),
            clip_low: Some(1.0),
            clip_high: Some(1.0),
            clip_region: Some(1.0),
            ..GrpoMetrics::default()
        }),
        checkpoint: Some(SaveTimes {
            blocked_s: 1.0,
            waited_s: 1.0,
            persisted_s: Some(1.0),
            persisted_cpu_s: Some(1.0),
            updates_waited_s: 1.0,
            locked_bytes: 1,
            locking_s: 1.0,
        }),
        val_loss: Some(1.0),
        val_perplexity: Some(1.0),
    }
}

/// The names in backticks that open the rows of `page`'s tables.
fn table_names(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_string()))
        .collect()
}

/// The paths of `value`'s leaves under `prefix`: the placements' and categories' map keys
/// as `<placement>` and `<category>`, a list of objects as `[]`.
fn paths(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(fields) => {
            for (key, v) in fields {
                let key = match prefix {
                    "memory" => "<placement>",
                    p if p.ends_with(".by_category") => "<category>",
                    _ => key,
                };
                let path = if prefix.is_empty() { key.to_string() } else { format!("{prefix}.{key}") };
                paths(v, &path, out);
            }
        }
        Value::Array(items) if items.first().is_some_and(Value::is_object) => {
            paths(&items[0], &format!("{prefix}[]"), out)
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

#[test]
fn the_metrics_page_names_every_field_and_only_those() {
    let mut written = BTreeSet::new();
    paths(&serde_json::to_value(full_report()).unwrap(), "", &mut written);
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/metrics.md")).unwrap();
    let documented = table_names(&page);
    let missing: Vec<_> = written.difference(&documented).collect();
    let gone: Vec<_> = documented.difference(&written).collect();
    assert!(missing.is_empty(), "metrics fields docs/metrics.md lacks: {missing:?}");
    assert!(gone.is_empty(), "docs/metrics.md names fields the code no longer writes: {gone:?}");
    // The map keys the placeholders stand for, each named on the page.
    for key in [serde_json::to_value(Placement::Device), serde_json::to_value(Placement::Host)] {
        let key = key.unwrap();
        assert!(page.contains(&format!("`{}`", key.as_str().unwrap())), "docs/metrics.md: placement {key}");
    }
    for c in [Category::Params, Category::Grads, Category::OptimizerState, Category::Activations] {
        let key = serde_json::to_value(c).unwrap();
        assert!(page.contains(&format!("`{}`", key.as_str().unwrap())), "docs/metrics.md: category {key}");
    }
}

/// The option names of `config` (a method's configuration as JSON), nested objects' too.
fn option_names(config: &Value, out: &mut BTreeSet<String>) {
    if let Value::Object(fields) = config {
        for (key, v) in fields {
            out.insert(key.clone());
            option_names(v, out);
        }
    }
}

#[test]
fn the_strategies_page_names_every_method_and_option_and_only_those() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/strategies.md")).unwrap();
    let mut options = BTreeSet::new();
    for method in strata::strategy::METHODS {
        // A method with no defaults is given the least it takes, a split its dimension.
        let mode = |dims: &str| format!(r#"["parallel_mode", [[{dims}], null]], "#);
        let text = match method {
            "checkpoint" => r#"[["checkpoint", ["GptBlock"]]]"#.to_string(),
            "expert_parallel" | "context_parallel" => format!(r#"[["{method}", {{"size": 2}}]]"#),
            "tensor_parallel" => format!(r#"[{}"{method}"]"#, mode(r#"["tensor", 2]"#)),
            "pipeline_parallel" => format!(r#"[{}"{method}"]"#, mode(r#"["pipeline", 2]"#)),
            "mixed_parallel" | "ds_3d_parallel" => {
                format!(r#"[{}"{method}"]"#, mode(r#"["tensor", 2], ["pipeline", 2]"#))
            }
            _ => format!(r#"["{method}"]"#),
        };
        let strategy = strata::strategy::Strategy::parse(&text).unwrap_or_else(|e| panic!("{method}: {e}"));
        let value = strategy.to_value();
        let entry = value.as_array().unwrap().iter().find(|m| m[0] == method).unwrap();
        option_names(&entry[1], &mut options);
        assert!(page.contains(&format!("| `{method}` |")), "docs/strategies.md has no row for method {method}");
    }
    let missing: Vec<_> = options.iter().filter(|o| !page.contains(&format!("`{o}`"))).collect();
    assert!(missing.is_empty(), "strategy options docs/strategies.md does not name: {missing:?}");
    let known: BTreeSet<String> = strata::strategy::METHODS.iter().map(|m| m.to_string()).chain(options).collect();
    let gone: Vec<_> = table_names(&page).into_iter().filter(|n| !known.contains(n)).collect();
    assert!(gone.is_empty(), "docs/strategies.md names methods or options the code lacks: {gone:?}");
}
