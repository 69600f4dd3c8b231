//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses its own subset
pub mod ranks;
pub mod tied_gpt;

use strata::compute::replace::Replacements;
use strata::compute::{self, UnitCompute};
use strata::engine::with_seed;
use strata::model::layers;
use tch::{Device, Kind, Tensor};

/// ‖a − b‖ / ‖b‖, in f64 on the CPU.
pub fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_device(Device::Cpu).to_kind(Kind::Double), b.to_device(Device::Cpu).to_kind(Kind::Double));
    (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

/// One replaced module against its reference composite.
pub struct ReplacedModule {
    pub name: &'static str,
    pub kind: Kind,
    /// Relative error of the replaced output, and its bound: fp32 rounding alone, or bf16's
    /// 8-bit mantissa.
    pub error: f64,
    pub bound: f64,
    /// The autograd nodes that made the replaced output and the composite's: they differ
    /// where the replacement ran.
    pub nodes: (String, String),
}

impl ReplacedModule {
    /// The replaced output is close to the composite's and came from another computation.
    pub fn check(&self, device: Device) {
        let Self { name, kind, error, bound, nodes } = self;
        eprintln!("{name} in {kind:?} on {device:?}: {error:.2e}, nodes {nodes:?}");
        assert!(error < bound, "{name} in {kind:?}: {error:e}");
        assert_ne!(nodes.0, nodes.1, "{name} in {kind:?}: the replacement did not run");
    }
}

/// Every replaced module (fused attention, layer norm, RMS norm) against its reference
/// composite on `device`, in fp32 and bf16.
pub fn replaced_modules(device: Device) -> Vec<ReplacedModule> {
    let all = std::sync::Arc::new(UnitCompute {
        replacements: Replacements::select(None).unwrap(),
        device_autocast: device.is_cuda(),
        ..Default::default()
    });
    let node = |t: &Tensor| strata_ext::grad_fn_name(t).unwrap().unwrap_or_default();
    let mut out = Vec::new();
    for (kind, bound) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2e-2)] {
        // Inputs that take gradients, so each output names the node that made it.
        let draw = |seed: i64, shape: &[i64]| {
            with_seed(seed, || Tensor::randn(shape, (kind, Device::Cpu))).to_device(device).set_requires_grad(true)
        };
        let (q, k, v) = (draw(1, &[2, 4, 64, 32]), draw(2, &[2, 4, 64, 32]), draw(3, &[2, 4, 64, 32]));
        let (x, w, b) = (draw(4, &[2, 64, 32]), draw(5, &[32]), draw(6, &[32]));
        let reference = [
            layers::causal_attention(&q, &k, &v, &Default::default(), None).unwrap(),
            layers::layer_norm(&x, &w, &b, 1e-5).unwrap(),
            layers::rms_norm(&x, &w, 1e-6).unwrap(),
        ];
        let replaced = compute::run(&all, Default::default(), false, || {
            Ok([
                layers::causal_attention(&q, &k, &v, &Default::default(), None)?,
                layers::layer_norm(&x, &w, &b, 1e-5)?,
                layers::rms_norm(&x, &w, 1e-6)?,
            ])
        })
        .unwrap();
        for (name, (a, r)) in ["attention", "layer norm", "rms norm"].into_iter().zip(reference.iter().zip(&replaced)) {
            assert_eq!((a.kind(), r.device()), (r.kind(), device), "{name} keeps its dtype and device");
            let error = rel(&r.detach(), &a.detach());
            out.push(ReplacedModule { name, kind, error, bound, nodes: (node(r), node(a)) });
        }
    }
    out
}
