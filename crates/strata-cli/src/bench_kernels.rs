//! `strata bench kernels`: Strata's own CPU kernels against the libtorch operators they
//! replace (`module_replace`'s `VectorGelu`, `FusedRMSNorm`, `FusedSwiGLU`, `FusedRoPE` and
//! `OneDnnLinear`), on fp32 tensors of GPT-2's and the 1.1B LLaMA's shapes, at each thread
//! count: milliseconds per call of each side (forward then backward from one upstream
//! gradient; the linear layer forward only, as its replacement serves), their ratio, and the
//! largest difference between the sides' outputs and input gradients.
use crate::bench::per_call_ms;
use anyhow::{bail, Context, Result};
use clap::Args;
use strata::model::layers;
use strata_ext::{kernels, onednn};
use tch::{Device, Kind, Tensor};

#[derive(Args, Debug)]
pub struct BenchKernelsArgs {
    /// Token rows of every input (a micro-batch's positions).
    #[arg(long, default_value_t = 2048)]
    tokens: i64,
    /// Thread counts to measure at, one after another.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<i32>,
    /// Calls timed per side after three warm-up calls; the best of --rounds such runs.
    #[arg(long, default_value_t = 10)]
    calls: u32,
    /// Runs of --calls calls per side, alternating the sides.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    kernel: &'static str,
    shape: String,
    threads: i32,
    strata_ms: f64,
    libtorch_ms: f64,
    /// libtorch's time over Strata's.
    speedup: f64,
    /// The largest difference between the two sides' outputs and input gradients.
    max_difference: f64,
}

/// One side of a case: its outputs, then its inputs' gradients.
type Side<'a> = Box<dyn Fn() -> Result<Vec<Tensor>> + 'a>;

struct Case<'a> {
    kernel: &'static str,
    shape: String,
    strata: Side<'a>,
    libtorch: Side<'a>,
}

/// An fp32 input that takes a gradient: normal values times `scale`, plus `shift`.
fn input(shape: &[i64], scale: f64, shift: f64) -> Tensor {
    (Tensor::randn(shape, (Kind::Float, Device::Cpu)) * scale + shift).set_requires_grad(true)
}

/// `forward`'s output and the gradients of `inputs` from the upstream gradient `upstream`.
fn forward_backward(
    inputs: &[&Tensor],
    upstream: &Tensor,
    forward: impl Fn() -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let y = forward()?;
    let options = strata_ext::GradOptions::default();
    let grads = strata_ext::grad(&[&y], &[upstream], inputs, options)?;
    let grads: Option<Vec<Tensor>> = grads.into_iter().collect();
    let mut out = vec![y.detach()];
    out.extend(grads.context("an input got no gradient")?);
    Ok(out)
}

/// A kernel that returns `None` where it does not serve has nothing to measure.
fn served(y: strata_ext::Result<Option<Tensor>>, kernel: &str) -> Result<Tensor> {
    y?.with_context(|| format!("{kernel}: Strata's kernel does not serve these tensors on this machine"))
}

/// The cases at `tokens` rows: GPT-2's GELU (3072 features) and linear layers (768 to
/// 3072), the 1.1B LLaMA's RMSNorm (2048), SwiGLU (5632) and rotary positions (32 heads of
/// 64 over 512-position rows).
fn cases<'a>(tokens: i64, t: &'a Tensors) -> Vec<Case<'a>> {
    let rows = tokens / 512;
    vec![
        Case {
            kernel: "VectorGelu",
            shape: format!("{tokens} x 3072"),
            strata: Box::new(|| {
                forward_backward(&[&t.gelu], &t.gelu_up, || served(kernels::gelu_tanh(&t.gelu), "gelu"))
            }),
            libtorch: Box::new(|| forward_backward(&[&t.gelu], &t.gelu_up, || Ok(layers::gelu_tanh(&t.gelu)?))),
        },
        Case {
            kernel: "FusedRMSNorm",
            shape: format!("{tokens} x 2048"),
            strata: Box::new(|| {
                forward_backward(&[&t.norm, &t.norm_w], &t.norm_up, || {
                    served(kernels::rms_norm(&t.norm, &t.norm_w, 1e-5), "rms_norm")
                })
            }),
            libtorch: Box::new(|| {
                forward_backward(&[&t.norm, &t.norm_w], &t.norm_up, || Ok(layers::rms_norm(&t.norm, &t.norm_w, 1e-5)?))
            }),
        },
        Case {
            kernel: "FusedSwiGLU",
            shape: format!("{tokens} x 5632"),
            strata: Box::new(|| {
                forward_backward(&[&t.gate, &t.up], &t.gate_up, || served(kernels::swiglu(&t.gate, &t.up), "swiglu"))
            }),
            libtorch: Box::new(|| {
                forward_backward(&[&t.gate, &t.up], &t.gate_up, || Ok(layers::swiglu(&t.gate, &t.up)?))
            }),
        },
        Case {
            kernel: "FusedRoPE",
            shape: format!("{rows} x 32 x 512 x 64"),
            strata: Box::new(|| {
                forward_backward(&[&t.heads], &t.heads_up, || {
                    served(kernels::rotary(&t.heads, &t.cos, &t.sin), "rotary")
                })
            }),
            libtorch: Box::new(|| {
                forward_backward(&[&t.heads], &t.heads_up, || Ok(layers::rotary(&t.heads, &t.cos, &t.sin)?))
            }),
        },
        Case {
            kernel: "OneDnnLinear",
            shape: format!("{tokens} x 768 -> 3072"),
            strata: Box::new(|| Ok(vec![tch::no_grad(|| onednn::linear(&t.x, &t.w, Some(&t.b)))?])),
            libtorch: Box::new(|| Ok(vec![tch::no_grad(|| layers::linear(&t.x, &t.w, Some(&t.b)))?])),
        },
    ]
}

/// Every case's inputs and upstream gradients, drawn once from a fixed seed.
struct Tensors {
    gelu: Tensor,
    gelu_up: Tensor,
    norm: Tensor,
    norm_w: Tensor,
    norm_up: Tensor,
    gate: Tensor,
    up: Tensor,
    gate_up: Tensor,
    heads: Tensor,
    cos: Tensor,
    sin: Tensor,
    heads_up: Tensor,
    x: Tensor,
    w: Tensor,
    b: Tensor,
}

impl Tensors {
    fn new(tokens: i64) -> Tensors {
        tch::manual_seed(0);
        let plain = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, Device::Cpu));
        let angles = Tensor::arange(512, (Kind::Float, Device::Cpu))
            .unsqueeze(1)
            .matmul(&Tensor::linspace(1.0, 1e-4, 32, (Kind::Float, Device::Cpu)).unsqueeze(0))
            .repeat([1, 2]);
        Tensors {
            gelu: input(&[tokens, 3072], 2.0, 0.0),
            gelu_up: plain(&[tokens, 3072]),
            norm: input(&[tokens, 2048], 1.0, 0.0),
            norm_w: input(&[2048], 0.1, 1.0),
            norm_up: plain(&[tokens, 2048]),
            gate: input(&[tokens, 5632], 2.0, 0.0),
            up: input(&[tokens, 5632], 1.0, 0.0),
            gate_up: plain(&[tokens, 5632]),
            heads: input(&[tokens / 512, 32, 512, 64], 1.0, 0.0),
            cos: angles.cos(),
            sin: angles.sin(),
            heads_up: plain(&[tokens / 512, 32, 512, 64]),
            x: plain(&[tokens, 768]),
            w: plain(&[3072, 768]) * 0.02,
            b: plain(&[3072]) * 0.02,
        }
    }
}

/// The best over `rounds` of the milliseconds per call of each side, the sides alternating
/// round by round, the first after three warm-up calls each.
fn time_sides(case: &Case<'_>, calls: u32, rounds: u32) -> Result<(f64, f64)> {
    let (mut ours, mut theirs) = (f64::INFINITY, f64::INFINITY);
    for round in 0..rounds {
        let warmup = if round == 0 { 3 } else { 0 };
        ours = ours.min(per_call_ms(Device::Cpu, (warmup, calls), &case.strata)?);
        theirs = theirs.min(per_call_ms(Device::Cpu, (warmup, calls), &case.libtorch)?);
    }
    Ok((ours, theirs))
}

/// The largest absolute difference between matching tensors of the two sides.
fn max_difference(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs().max().double_value(&[])).fold(0.0, f64::max)
}

pub fn run(args: BenchKernelsArgs) -> Result<()> {
    if args.tokens < 512 || args.tokens % 512 != 0 || args.calls == 0 || args.rounds == 0 {
        bail!("--tokens must be a positive multiple of 512, --calls and --rounds positive");
    }
    if let Some(bad) = args.threads.iter().find(|&&t| t < 1) {
        bail!("--threads {bad}: a thread count is at least 1");
    }
    if !onednn::available() {
        bail!("this libtorch has no oneDNN: OneDnnLinear has no kernel to measure");
    }
    let tensors = Tensors::new(args.tokens);
    let mut rows = vec![];
    for &threads in &args.threads {
        tch::set_num_threads(threads);
        for case in cases(args.tokens, &tensors) {
            let difference = max_difference(&(case.strata)()?, &(case.libtorch)()?);
            let (strata_ms, libtorch_ms) = time_sides(&case, args.calls, args.rounds)?;
            rows.push(Row {
                kernel: case.kernel,
                shape: case.shape,
                threads,
                strata_ms,
                libtorch_ms,
                speedup: libtorch_ms / strata_ms,
                max_difference: difference,
            });
        }
    }
    if args.json {
        println!("{}", serde_json::json!({ "tokens": args.tokens, "rows": rows }));
        return Ok(());
    }
    println!("fp32 on the CPU, forward and backward (OneDnnLinear forward only); best of {} rounds", args.rounds);
    println!("| kernel | shape | threads | Strata ms | libtorch ms | libtorch / Strata | max difference |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2}x | {:.1e} |",
            r.kernel, r.shape, r.threads, r.strata_ms, r.libtorch_ms, r.speedup, r.max_difference
        );
    }
    Ok(())
}
