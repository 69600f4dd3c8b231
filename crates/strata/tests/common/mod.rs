//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses its own subset
pub mod ranks;
pub mod tied_gpt;

use strata::compute::replace::Replacements;
use strata::compute::{self, UnitCompute};
use strata::engine::with_seed;
use strata::model::layers;
use tch::{Device, Kind, Tensor};

/// A BERT classifier of one block, 16 wide, over byte ids, labelling `labels`, for texts
/// of up to `max_positions` tokens in `type_vocab` token types.
pub fn tiny_bert_classifier(max_positions: i64, type_vocab: i64, labels: &[&str]) -> strata::model::BertConfig {
    strata::model::BertConfig {
        vocab: 256,
        max_positions,
        type_vocab,
        layers: 1,
        heads: 2,
        dim: 16,
        ffn_dim: 32,
        norm_eps: 1e-12,
        padding: Some(0),
        head: strata::model::BertHead::Classify { labels: labels.iter().map(|l| l.to_string()).collect() },
        dropout: strata::model::DropoutRates::NONE,
    }
}

/// ‖a − b‖ / ‖b‖, in f64 on the CPU.
pub fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_device(Device::Cpu).to_kind(Kind::Double), b.to_device(Device::Cpu).to_kind(Kind::Double));
    (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

/// One replaced module against its reference composite.
pub struct ReplacedModule {
    pub name: &'static str,
    pub kind: Kind,
    /// Largest relative error of the replaced outputs and of the gradients they send to
    /// their inputs, and its bound: fp32 rounding alone, or bf16's 8-bit mantissa.
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

/// A module's outputs from its inputs.
type Module = Box<dyn Fn(&[Tensor]) -> strata::Result<Vec<Tensor>>>;

/// The gradients `outputs` send back to those of `inputs` that take one, for upstream
/// gradients drawn from a fixed seed.
fn input_grads(outputs: &[Tensor], inputs: &[Tensor]) -> Vec<Tensor> {
    let upstream: Vec<Tensor> = outputs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let g = with_seed(30 + i as i64, || Tensor::randn(o.size(), (Kind::Float, Device::Cpu)));
            g.to_kind(o.kind()).to_device(o.device())
        })
        .collect();
    let taking: Vec<&Tensor> = inputs.iter().filter(|t| t.requires_grad()).collect();
    let outputs: Vec<&Tensor> = outputs.iter().collect();
    let options = strata_ext::GradOptions { allow_unused: true, ..Default::default() };
    let grads = strata_ext::grad(&outputs, &upstream.iter().collect::<Vec<_>>(), &taking, options).unwrap();
    grads.into_iter().map(|g| g.expect("every input takes a gradient")).collect()
}

/// Every replaced module (fused attention, layer norm, RMS norm, and Strata's kernels:
/// GELU, SwiGLU, rotary positions, cross-entropy, residual sum with layer or RMS norm)
/// against its reference composite on `device`, in fp32 and bf16, forward and backward;
/// Strata's kernels only where they serve (the CPU's vectorised ones in fp32, the CUDA
/// ones on a GPU).
pub fn replaced_modules(device: Device) -> Vec<ReplacedModule> {
    let all = std::sync::Arc::new(UnitCompute {
        replacements: Replacements::select(None).unwrap(),
        device_autocast: device.is_cuda(),
        ..Default::default()
    });
    let node = |t: &Tensor| strata_ext::grad_fn_name(t).unwrap().unwrap_or_default();
    let mut out = Vec::new();
    for (kind, bound) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2e-2)] {
        let draw_as = |seed: i64, shape: &[i64], kind: Kind| {
            with_seed(seed, || Tensor::randn(shape, (Kind::Float, Device::Cpu))).to_kind(kind).to_device(device)
        };
        // Inputs that take gradients, so each output names the node that made it.
        let draw = |seed: i64, shape: &[i64]| draw_as(seed, shape, kind).set_requires_grad(true);
        let own_kernels = device.is_cuda() || kind == Kind::Float;
        let angles = draw_as(20, &[16, 8], Kind::Float);
        let targets = with_seed(21, || Tensor::randint(50, [2, 8], (Kind::Int64, Device::Cpu)))
            .index_fill(1, &Tensor::from_slice(&[0i64, 5]), layers::IGNORE)
            .to_device(device);
        let mut cases: Vec<(&'static str, bool, Vec<Tensor>, Module)> = vec![
            (
                "attention",
                true,
                vec![draw(1, &[2, 4, 64, 32]), draw(2, &[2, 4, 64, 32]), draw(3, &[2, 4, 64, 32])],
                Box::new(|t| {
                    Ok(vec![layers::attention(
                        &t[0],
                        &t[1],
                        &t[2],
                        &Default::default(),
                        None,
                        Default::default(),
                        None,
                    )?])
                }),
            ),
            (
                "layer norm",
                true,
                vec![draw(4, &[2, 64, 32]), draw(5, &[32]), draw(6, &[32])],
                Box::new(|t| Ok(vec![layers::layer_norm(&t[0], &t[1], &t[2], 1e-5)?])),
            ),
            (
                "rms norm",
                true,
                vec![draw(4, &[2, 64, 32]), draw(5, &[32])],
                Box::new(|t| Ok(vec![layers::rms_norm(&t[0], &t[1], 1e-6)?])),
            ),
            ("gelu", own_kernels, vec![draw(7, &[2, 64, 48])], Box::new(|t| Ok(vec![layers::gelu_tanh(&t[0])?]))),
            (
                "swiglu",
                own_kernels,
                vec![draw(8, &[2, 64, 48]), draw(9, &[2, 64, 48])],
                Box::new(|t| Ok(vec![layers::swiglu(&t[0], &t[1])?])),
            ),
            (
                "rotary",
                own_kernels,
                // `[B, T, H, D]` seen as `[B, H, T, D]`, as queries are.
                vec![draw(10, &[2, 16, 4, 8]), angles.cos().to_kind(kind), angles.sin().to_kind(kind)],
                Box::new(|t| Ok(vec![layers::rotary(&t[0].transpose(1, 2), &t[1], &t[2])?])),
            ),
            (
                "cross-entropy",
                device.is_cuda(),
                vec![draw(11, &[2, 8, 50]), targets],
                Box::new(|t| Ok(vec![layers::cross_entropy(&t[0], &t[1])?])),
            ),
            (
                "residual + layer norm",
                device.is_cuda(),
                vec![draw(12, &[2, 64, 32]), draw(13, &[2, 64, 32]), draw(5, &[32]), draw(6, &[32])],
                Box::new(|t| {
                    let (s, y) = layers::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-5)?;
                    Ok(vec![y, s])
                }),
            ),
            (
                "residual + rms norm",
                device.is_cuda(),
                vec![draw(12, &[2, 64, 32]), draw(13, &[2, 64, 32]), draw(5, &[32])],
                Box::new(|t| {
                    let (s, y) = layers::add_rms_norm(&t[0], &t[1], &t[2], 1e-6)?;
                    Ok(vec![y, s])
                }),
            ),
        ];
        if kind == Kind::BFloat16 {
            // Mixed precision's residual stream: fp32, with a bf16 branch added to it.
            let fp32 = |seed: i64, shape: &[i64]| draw_as(seed, shape, Kind::Float).set_requires_grad(true);
            cases.push((
                "fp32 residual + bf16 branch, layer norm",
                device.is_cuda(),
                vec![fp32(12, &[2, 64, 32]), draw(13, &[2, 64, 32]), fp32(5, &[32]), fp32(6, &[32])],
                Box::new(|t| {
                    let (s, y) = layers::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-5)?;
                    Ok(vec![y, s])
                }),
            ));
        }
        for (name, _, inputs, module) in cases.into_iter().filter(|c| c.1) {
            let fresh =
                || -> Vec<Tensor> { inputs.iter().map(|t| t.detach().set_requires_grad(t.requires_grad())).collect() };
            let run = |policy: Option<&std::sync::Arc<UnitCompute>>| {
                let inputs = fresh();
                let outputs = match policy {
                    Some(policy) => compute::run(policy, Default::default(), false, || module(&inputs)).unwrap(),
                    None => module(&inputs).unwrap(),
                };
                let grads = input_grads(&outputs, &inputs);
                (outputs, grads)
            };
            let ((reference, reference_grads), (replaced, replaced_grads)) = (run(None), run(Some(&all)));
            let mut error: f64 = 0.0;
            for (r, a) in replaced.iter().chain(&replaced_grads).zip(reference.iter().chain(&reference_grads)) {
                assert_eq!((a.kind(), r.device()), (r.kind(), device), "{name} keeps its dtype and device");
                error = error.max(rel(&r.detach(), &a.detach()));
            }
            out.push(ReplacedModule { name, kind, error, bound, nodes: (node(&replaced[0]), node(&reference[0])) });
        }
    }
    out
}
