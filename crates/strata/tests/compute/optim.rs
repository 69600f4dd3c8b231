use strata::engine::{Engine, EngineConfig};
use strata::model::{self, Builder, MlpConfig};
use strata::optim::{GroupRule, Optimizer, OptimizerConfig, OptimizerKind};
use tch::Kind;

fn mlp_engine() -> Engine {
    let mut b = Builder::new();
    model::mlp(&MlpConfig { vocab: 7, layers: 2, dim: 4 }, &mut b).unwrap();
    Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap()
}

fn snapshot(e: &Engine) -> Vec<(String, tch::Tensor)> {
    e.named_params().map(|(n, t)| (n.to_string(), t.detach().copy())).collect()
}

#[test]
fn parameter_groups_get_their_own_weight_decay_and_segments_stay_contiguous() {
    let _serial = crate::serial();
    let mut e = mlp_engine();
    let rules = [GroupRule { name_contains: vec!["bias".into()], weight_decay: Some(0.0), lr: None }];
    // Each layer unit holds weight then bias: two segments of different groups.
    let segments = e.segments(|p| usize::from(p.name.contains("bias"))).unwrap();
    assert_eq!(segments.len(), 1 + 2 * 2 + 2, "embedding, 2 × (weight, bias), head weight and bias");
    let mut opt =
        Optimizer::new(&mut e, OptimizerConfig { lr: 0.1, weight_decay: 0.5, ..Default::default() }, &rules).unwrap();
    let before = snapshot(&e);
    // Zero gradients: AdamW moves parameters only through decoupled weight decay.
    opt.step().unwrap();
    for ((name, old), (_, new)) in before.iter().zip(e.named_params()) {
        let expected = if name.contains("bias") { old.shallow_clone() } else { old * (1.0 - 0.1 * 0.5) };
        assert!(new.allclose(&expected, 1e-6, 1e-7, false), "{name}");
    }
}

/// With `decay_norms_and_biases` off, GPT-2's LayerNorms (named `ln_*`, found by what they
/// are) and every bias keep their values under decay alone, while a group's own rule still
/// decays what it names.
#[test]
fn norms_and_biases_can_be_left_out_of_weight_decay() {
    let _serial = crate::serial();
    let mut b = Builder::new();
    model::gpt(&model::GptConfig::new(11, 8, 2, 2, 4), &mut b).unwrap();
    let mut e = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
    let rules = [GroupRule { name_contains: vec!["ln_f".into()], weight_decay: Some(0.2), lr: None }];
    let config = OptimizerConfig { lr: 0.1, weight_decay: 0.5, decay_norms_and_biases: false, ..Default::default() };
    let mut opt = Optimizer::new(&mut e, config, &rules).unwrap();
    let before = snapshot(&e);
    opt.step().unwrap();
    let mut kept = 0;
    for ((name, old), (_, new)) in before.iter().zip(e.named_params()) {
        let factor = match name.as_str() {
            n if n.contains("ln_f") => 1.0 - 0.1 * 0.2,
            n if n.contains(".ln_") || n.ends_with("bias") => 1.0,
            _ => 1.0 - 0.1 * 0.5,
        };
        kept += usize::from(factor == 1.0);
        assert!(new.allclose(&(old * factor), 1e-6, 1e-7, false), "{name}");
    }
    // Two layers' two LayerNorms (weight and bias) and their four biases of products.
    assert_eq!(kept, 2 * (2 * 2 + 4), "{:?}", before.iter().map(|(n, _)| n).collect::<Vec<_>>());
}

#[test]
fn sgd_and_adam_follow_their_update_rules_on_engine_storage() {
    let _serial = crate::serial();
    for kind in [OptimizerKind::Sgd, OptimizerKind::Adam] {
        let mut e = mlp_engine();
        let config = OptimizerConfig { kind, lr: 0.1, weight_decay: 0.0, ..Default::default() };
        let mut opt = Optimizer::new(&mut e, config, &[]).unwrap();
        for s in e.storage() {
            let _ = s.grad.shallow_clone().fill_(0.5);
        }
        let before = snapshot(&e);
        opt.step().unwrap();
        // SGD: p - lr·g = p - 0.05. Adam's first step: p - lr·sign(g) = p - 0.1.
        let delta = if kind == OptimizerKind::Sgd { 0.05 } else { 0.1 };
        for ((name, old), (_, new)) in before.iter().zip(e.named_params()) {
            assert!(new.allclose(&(old - delta), 1e-5, 1e-6, false), "{kind:?} {name}");
        }
    }
}

/// The global norm reduces each gradient in its own precision, as `clip_grad_norm_` does:
/// asked for f64 from fp32, libtorch would first write an f64 copy of each gradient. The
/// sum of squares stays within fp32's precision of the exact one computed in f64 (1.7e-6
/// relative here).
#[test]
fn the_gradient_norm_reads_the_gradients_without_copying_them() {
    let _serial = crate::serial();
    let mut b = Builder::new();
    model::mlp(&MlpConfig { vocab: 64, layers: 2, dim: 512 }, &mut b).unwrap();
    let mut e = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
    let opt = Optimizer::new(&mut e, OptimizerConfig::default(), &[]).unwrap();
    tch::manual_seed(3);
    for s in e.storage() {
        let _ = s.grad.shallow_clone().normal_(0.0, 1.0);
    }
    let grad_bytes: i64 = e.storage().iter().map(|s| s.grad.numel() as i64 * 4).sum();
    let exact = e
        .storage()
        .iter()
        .map(|s| s.grad.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]))
        .sum::<f64>();
    strata_ext::cpu_memory::track().unwrap();
    let held = strata_ext::cpu_memory::stats().unwrap().0;
    strata_ext::cpu_memory::reset_peak().unwrap();
    let squares: f64 = opt.grad_sq_per_unit().unwrap().iter().map(|(_, x)| x).sum();
    let extra = strata_ext::cpu_memory::stats().unwrap().1 - held;
    let error = ((squares - exact) / exact).abs();
    eprintln!("sum of squares {squares} (exact {exact}, relative error {error:e}); {extra} bytes beside {grad_bytes}");
    assert!(exact > 1e5 && error < 1e-5, "{squares} vs {exact}");
    assert!(extra < grad_bytes / 8, "the norm allocated {extra} bytes beside {grad_bytes} of gradients");
}

#[test]
fn clipping_scales_the_global_norm_down_to_the_limit() {
    let _serial = crate::serial();
    let mut e = mlp_engine();
    let mut opt = Optimizer::new(&mut e, OptimizerConfig::default(), &[]).unwrap();
    let numel: i64 = e.spec().num_params();
    for s in e.storage() {
        let _ = s.grad.shallow_clone().fill_(1.0);
    }
    let norm = opt.clip_grad_norm(2.0).unwrap();
    assert!((norm - (numel as f64).sqrt()).abs() < 1e-3);
    let after: f64 = e.storage().iter().map(|s| s.grad.square().sum(Kind::Double).double_value(&[])).sum();
    assert!((after.sqrt() - 2.0).abs() < 1e-4, "clipped norm {}", after.sqrt());
    let ledger = e.ledger().report();
    let state = ledger[&strata::engine::Placement::Device].by_category[&strata::engine::Category::OptimizerState];
    assert_eq!(state as i64, 2 * 4 * numel, "two fp32 moments per parameter are accounted");
}
