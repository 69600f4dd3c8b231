//! `fp8`: linear layers computed with libtorch's scaled matrix multiply on fp8 operands.
//! Scales come one of three ways ([`Fp8Scaling`]). Delayed (Transformer Engine's): each fp8
//! linear keeps, for its input, weight and output gradient, a history of absolute maxima
//! (`amax_history_len` steps); the scale used in a step comes from the history before it
//! (`fp8_max / amax / 2^margin`, amax the history's maximum or its most recent entry),
//! refreshed every `interval` steps. Current: each tensor's scale from its own maximum,
//! taken on the device just before its cast. Rowwise: a scale per row of each operand as
//! its product reads it. Input and weight are E4M3; the gradient is E5M2 (`HYBRID`) or
//! E4M3, and E4M3 under rowwise scaling.
//!
//! Owns each fp8 linear's scaling state and its scaled product. Must not own weights or
//! steps: the engine hands the weights in, ends each step through [`end_steps`] and passes
//! the group whose ranks agree on the maxima.
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::error::text;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// The fp8 formats of a linear layer's operands (Transformer Engine's `fp8_format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fp8Format {
    /// E4M3 forward, E5M2 gradients.
    #[serde(rename = "HYBRID")]
    Hybrid,
    /// E4M3 for every operand, gradients included.
    #[serde(rename = "E4M3")]
    E4m3,
}

/// How an fp8 linear chooses the scales that bring its operands into fp8's range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Scaling {
    /// From the maxima of earlier steps, per tensor role, read on the host when a step ends.
    #[default]
    Delayed,
    /// Per tensor, from its own maximum, computed on the device before its cast: no
    /// history, nothing read on the host (a step can be captured as a CUDA graph).
    Current,
    /// Per row of each operand as its product reads it (and per column for the transposed
    /// copy backward reads), from the device: an outlier costs its own row's precision
    /// alone. Every operand, gradients included, in E4M3; on a GPU the products come out in
    /// bf16 (libtorch's rowwise kernels write no other dtype) and are cast from there.
    Rowwise,
}

/// Which amax of a history sets a delayed scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmaxAlgo {
    /// The history's largest.
    Max,
    /// The history's most recent entry.
    MostRecent,
}

/// The `fp8` method's configuration (Transformer Engine's `DelayedScaling` and ATorch's
/// `include`/`exclude`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Fp8Config {
    /// How the scales are chosen (default: delayed).
    pub scaling: Fp8Scaling,
    /// Delayed scales are divided by `2^margin` (default 0).
    pub margin: i32,
    /// Steps between refreshes of the delayed scales (default 1).
    pub interval: u64,
    /// The operands' formats (default: `HYBRID`).
    pub fp8_format: Fp8Format,
    /// Steps of amaxes each delayed scale's history keeps (default 1024).
    pub amax_history_len: usize,
    /// Which amax of the history sets a delayed scale (default: the largest).
    pub amax_compute_algo: AmaxAlgo,
    /// Take the maximum of each amax over the data-parallel ranks.
    pub reduce_amax: bool,
    /// Only linear layers whose weight name contains one of these (all when empty).
    pub include: Vec<String>,
    /// No linear layer whose weight name contains one of these.
    pub exclude: Vec<String>,
    /// No linear layer with fewer input or output features than this: a product that
    /// small gains less from fp8 than its operands' casts cost (0: no such limit).
    pub min_features: i64,
}

impl Default for Fp8Config {
    fn default() -> Self {
        Fp8Config {
            scaling: Fp8Scaling::Delayed,
            margin: 0,
            interval: 1,
            fp8_format: Fp8Format::Hybrid,
            amax_history_len: 1024,
            amax_compute_algo: AmaxAlgo::Max,
            reduce_amax: true,
            include: vec![],
            exclude: vec![],
            min_features: 0,
        }
    }
}

impl Fp8Config {
    /// Checks that `interval` and `amax_history_len` are positive and `min_features` not negative.
    pub fn validate(&self) -> Result<()> {
        if self.interval == 0 || self.amax_history_len == 0 {
            return Err(Error::Config("fp8: interval and amax_history_len must be positive".into()));
        }
        if self.min_features < 0 {
            return Err(Error::Config(format!("fp8: min_features must not be negative, got {}", self.min_features)));
        }
        Ok(())
    }

    /// The fp8 type of gradients and its largest value.
    pub fn grad_format(&self) -> (Kind, f64) {
        match (self.fp8_format, self.scaling) {
            (Fp8Format::Hybrid, Fp8Scaling::Delayed | Fp8Scaling::Current) => (Kind::Float8e5m2, E5M2_MAX),
            _ => (Kind::Float8e4m3fn, E4M3_MAX),
        }
    }

    /// Whether the linear layer with weight `name` and shape `[out, in]` runs in fp8:
    /// included, not excluded, both dimensions multiples of 16 and at least `min_features`.
    pub fn applies_to(&self, name: &str, shape: &[i64]) -> bool {
        self.admits(name, shape) && !self.too_small(shape)
    }

    /// Whether the weight is left in bf16 for its size alone.
    pub fn too_small(&self, shape: &[i64]) -> bool {
        shape.iter().any(|&d| d < self.min_features)
    }

    /// Included, not excluded, a matrix both of whose dimensions are multiples of 16.
    fn admits(&self, name: &str, shape: &[i64]) -> bool {
        let included = self.include.is_empty() || self.include.iter().any(|s| name.contains(s.as_str()));
        let excluded = self.exclude.iter().any(|s| name.contains(s.as_str()));
        included && !excluded && shape.len() == 2 && shape.iter().all(|d| d % 16 == 0)
    }

    /// The weights (by name and shape) it computes in fp8 and those it leaves in bf16 for
    /// their size, as a line for the log.
    pub fn describe(&self, weights: &[(&str, &[i64])]) -> String {
        let admitted: Vec<&(&str, &[i64])> = weights.iter().filter(|(n, s)| self.admits(n, s)).collect();
        let small: Vec<String> =
            admitted.iter().filter(|(_, s)| self.too_small(s)).map(|(n, s)| format!("{n} {s:?}")).collect();
        let mut line = format!("fp8: {} of {} linear weights", admitted.len() - small.len(), admitted.len());
        if !small.is_empty() {
            line += &format!("; below {} features, in bf16: {}", self.min_features, small.join(", "));
        }
        line
    }
}

/// Why fp8 products cannot run on `device`, if they cannot: they need a GPU of compute
/// capability 8.9 or newer (on the CPU libtorch emulates them).
pub fn unsupported_on(device: tch::Device) -> Option<String> {
    let tch::Device::Cuda(index) = device else { return None };
    match strata_ext::cuda::compute_capability(index) {
        Ok(cc) if cc >= (8, 9) => None,
        Ok((major, minor)) => {
            Some(format!("fp8 needs a GPU of compute capability 8.9 or newer, this one is {major}.{minor}"))
        }
        Err(e) => Some(format!("cannot read the GPU's compute capability ({e})")),
    }
}

const E4M3_MAX: f64 = 448.0;
const E5M2_MAX: f64 = 57344.0;

/// Amax history and scale of one tensor role of one linear layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Meter {
    /// Amaxes of past steps, oldest first (at most `amax_history_len`, non-finite ones left out).
    pub history: VecDeque<f64>,
    /// Largest amax seen in the current step.
    pub pending: f64,
    /// Delayed scaling's factor applied before the cast (`fp8_max / amax / 2^margin`; 1 until set).
    pub scale: f64,
}

impl Meter {
    fn new() -> Meter {
        Meter { history: VecDeque::new(), pending: 0.0, scale: 1.0 }
    }
}

/// The three meters of one fp8 linear layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearMeters {
    /// The layer input's meter.
    pub input: Meter,
    /// The weight's meter.
    pub weight: Meter,
    /// The output gradient's meter.
    pub grad: Meter,
}

impl LinearMeters {
    fn meters_mut(&mut self) -> [&mut Meter; 3] {
        [&mut self.input, &mut self.weight, &mut self.grad]
    }
}

/// The tensor roles of an fp8 linear, in [`LinearMeters`] order.
#[derive(Clone, Copy)]
enum Role {
    Input = 0,
    Weight = 1,
    Grad = 2,
}

/// The fp8 state of one unit: its linear layers in call order.
pub struct Fp8Unit {
    /// The `fp8` configuration the unit runs under.
    pub config: Fp8Config,
    /// Each fp8 linear layer's meters, in call order.
    pub layers: Vec<LinearMeters>,
    /// The step's running amaxes per layer and role, still where the tensors live: read
    /// back once, when the step ends, so recording never waits for the device.
    observed: Vec<[Option<Tensor>; 3]>,
    /// Per layer, its weight cast to fp8 in this step: weights change only between steps,
    /// so every forward of a step (micro-batches, recomputation) reuses one cast.
    weights: Vec<Option<Cast>>,
    steps: u64,
}

/// A unit's fp8 state, shared by its layers' products and the engine that ends its steps.
pub type SharedFp8 = Arc<Mutex<Fp8Unit>>;

/// What a checkpoint keeps of a unit's fp8 state: histories and scales, and the step count
/// that times the scale refreshes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fp8Snapshot {
    /// Each fp8 linear layer's meters, in call order.
    pub layers: Vec<LinearMeters>,
    /// Steps ended so far; every `interval` of them refreshes the scales.
    pub steps: u64,
}

impl Fp8Snapshot {
    /// Why the state cannot be resumed from, if it cannot: every scale finite and positive,
    /// every recorded maximum finite and not negative.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (i, layer) in self.layers.iter().enumerate() {
            for meter in [&layer.input, &layer.weight, &layer.grad] {
                if !(meter.scale.is_finite() && meter.scale > 0.0) {
                    return Err(format!("fp8 layer {i} has a scale of {}", meter.scale));
                }
                if let Some(m) = meter.history.iter().chain([&meter.pending]).find(|m| !(m.is_finite() && **m >= 0.0)) {
                    return Err(format!("fp8 layer {i} records a maximum of {m}"));
                }
            }
        }
        Ok(())
    }
}

impl Fp8Unit {
    /// A state under `config` with no layers yet: each joins when it first runs.
    pub fn new(config: Fp8Config) -> SharedFp8 {
        Arc::new(Mutex::new(Fp8Unit {
            config,
            layers: Vec::new(),
            observed: Vec::new(),
            weights: Vec::new(),
            steps: 0,
        }))
    }

    /// The histories, scales and step count, for a checkpoint.
    pub fn snapshot(&self) -> Fp8Snapshot {
        Fp8Snapshot { layers: self.layers.clone(), steps: self.steps }
    }

    /// Takes back a checkpoint's histories, scales and step count; the step's running
    /// maxima and weight casts start afresh.
    pub fn restore(&mut self, snapshot: &Fp8Snapshot) {
        self.layers = snapshot.layers.clone();
        self.observed = self.layers.iter().map(|_| Default::default()).collect();
        self.weights = self.layers.iter().map(|_| None).collect();
        self.steps = snapshot.steps;
    }

    /// Takes a tensor's absolute maximum `amax` (a scalar where the tensor lives) into the
    /// step's running maximum of `role` of layer `slot` (NaN ignored, as `f64::max` would).
    fn observe(&mut self, slot: usize, role: Role, amax: &Tensor) -> Result<()> {
        let amax = amax.shallow_clone();
        let cell = &mut self.observed[slot][role as usize];
        *cell = Some(match cell.take() {
            Some(before) => before.f_fmax(&amax)?,
            None => amax,
        });
        Ok(())
    }

    /// Ends a step of this unit alone (see [`end_steps`]).
    pub fn end_step(&mut self, group: Option<&dyn ProcessGroup>) -> Result<()> {
        end_steps(&mut [self], group)
    }

    /// The step's amaxes of every layer and role, in [`LinearMeters`] order.
    fn pending(&self) -> Vec<f64> {
        self.layers.iter().flat_map(|l| [l.input.pending, l.weight.pending, l.grad.pending]).collect()
    }

    /// The step's amaxes (`pending`, three per layer) enter the histories, and every
    /// `interval` steps the scales are recomputed from them.
    fn take_step(&mut self, pending: &[f64]) {
        self.steps += 1;
        // The weights are about to change.
        self.weights.iter_mut().for_each(|w| *w = None);
        if self.config.scaling != Fp8Scaling::Delayed {
            return;
        }
        let refresh = self.steps.is_multiple_of(self.config.interval);
        let (fwd_max, grad_max) = (E4M3_MAX, self.config.grad_format().1);
        let c = &self.config;
        for (l, amaxes) in self.layers.iter_mut().zip(pending.chunks(3)) {
            for (meter, (&amax, fp8_max)) in [&mut l.input, &mut l.weight, &mut l.grad]
                .into_iter()
                .zip(amaxes.iter().zip([fwd_max, fwd_max, grad_max]))
            {
                // An overflowing step (inf/NaN amax) must not freeze the scale for a whole
                // history: it is left out.
                if amax.is_finite() {
                    meter.history.push_back(amax);
                }
                while meter.history.len() > c.amax_history_len {
                    meter.history.pop_front();
                }
                meter.pending = 0.0;
                if refresh {
                    let amax = match c.amax_compute_algo {
                        AmaxAlgo::Max => meter.history.iter().copied().fold(0.0, f64::max),
                        AmaxAlgo::MostRecent => meter.history.back().copied().unwrap_or(0.0),
                    };
                    if amax > 0.0 && amax.is_finite() {
                        meter.scale = fp8_max / amax / 2f64.powi(c.margin);
                    }
                }
            }
        }
    }
}

/// Ends a step of `units`, whether it updated or was skipped: the amaxes observed on the
/// device are read back in one transfer (the step's one synchronisation for fp8), those of
/// units with `reduce_amax` take their maximum over `group` in one all-reduce, and every
/// unit's histories and scales move on.
pub fn end_steps(units: &mut [&mut Fp8Unit], group: Option<&dyn ProcessGroup>) -> Result<()> {
    let mut observed = Vec::new();
    let mut places = Vec::new();
    for (u, unit) in units.iter_mut().enumerate() {
        for (l, roles) in unit.observed.iter_mut().enumerate() {
            for (r, amax) in roles.iter_mut().enumerate() {
                if let Some(amax) = amax.take() {
                    observed.push(amax);
                    places.push((u, l, r));
                }
            }
        }
    }
    for ((u, l, r), amax) in places.into_iter().zip(super::read_scalars(&observed)?) {
        let meter = &mut units[u].layers[l].meters_mut()[r];
        meter.pending = meter.pending.max(amax);
    }
    let mut pending: Vec<Vec<f64>> = units.iter().map(|u| u.pending()).collect();
    let delayed = |u: &Fp8Unit| u.config.reduce_amax && u.config.scaling == Fp8Scaling::Delayed;
    let reduced: Vec<usize> = (0..units.len()).filter(|&u| delayed(units[u]) && !pending[u].is_empty()).collect();
    if let (Some(g), false) = (group, reduced.is_empty()) {
        let all: Vec<f64> = reduced.iter().flat_map(|&u| pending[u].iter().copied()).collect();
        let mut maxima = all_reduce_values(g, &all, ReduceOp::Max)?.into_iter();
        for &u in &reduced {
            pending[u] = maxima.by_ref().take(pending[u].len()).collect();
        }
    }
    for (unit, pending) in units.iter_mut().zip(pending) {
        unit.take_step(&pending);
    }
    Ok(())
}

/// How one operand is scaled into fp8 in a step.
#[derive(Clone, Copy)]
enum Scale {
    /// Delayed scaling's, decided on the host before the step.
    Given(f64),
    /// From the tensor's own maximum, on the device.
    Current,
    /// From each row's maximum (and each column's, for the transpose), on the device.
    Rowwise,
}

/// A 2-D tensor cast to fp8: row-major, its contiguous transpose (the column-major operand
/// of a scaled product), with what multiplies each back out of its products (the inverse
/// scales, on the device: one float for the tensor, or under rowwise scaling one per row of
/// `q`, `[rows, 1]`, and one per row of `qt`, `[cols, 1]`), and, under delayed scaling, the
/// tensor's largest magnitude before scaling (a float scalar where it lives).
struct Cast {
    q: Tensor,
    q_factor: Tensor,
    qt: Tensor,
    qt_factor: Tensor,
    amax: Option<Tensor>,
}

impl Cast {
    fn shallow_clone(&self) -> Cast {
        Cast {
            q: self.q.shallow_clone(),
            q_factor: self.q_factor.shallow_clone(),
            qt: self.qt.shallow_clone(),
            qt_factor: self.qt_factor.shallow_clone(),
            amax: self.amax.as_ref().map(Tensor::shallow_clone),
        }
    }
}

/// The smallest maximum a scale is taken from (torchao's floor): an all-zero tensor, row or
/// column (a padding row, a gradient that is zero everywhere) would otherwise scale by
/// infinity, and 0 · ∞ casts to NaN.
const AMAX_FLOOR: f64 = 1e-12;

/// `t · scale`, saturated to ±`max`, in fp8 `kind`, with its transpose. On a GPU one pass of
/// Strata's CUDA kernel casts both copies (rowwise scales come from one more pass that
/// takes every row's and column's maximum); elsewhere composite ops, scaling in `t`'s own
/// dtype (bf16 keeps more mantissa than either fp8 format) or, per row, in fp32.
fn cast(t: &Tensor, scale: Scale, kind: Kind, max: f64) -> Result<Cast> {
    use strata_ext::kernels::{self, Fp8Scale};
    let t = t.f_contiguous()?;
    let e5m2 = kind == Kind::Float8e5m2;
    // What brings a maximum (fp32, on the device) to the format's largest value.
    let scale_of =
        |amax: &Tensor| -> Result<Tensor> { Ok(amax.f_clamp_min(AMAX_FLOOR)?.f_reciprocal()?.f_mul_scalar(max)?) };
    let saturate = |scaled: Tensor| -> Result<Tensor> { Ok(scaled.f_clamp(-max, max)?.f_to_kind(kind)?) };
    match scale {
        Scale::Rowwise => {
            let (rows, cols) = match kernels::row_col_amax(&t)? {
                Some(found) => found,
                None => {
                    let along =
                        |d: i64| -> Result<Tensor> { Ok(t.f_abs()?.f_amax([d], false)?.f_to_kind(Kind::Float)?) };
                    (along(1)?, along(0)?)
                }
            };
            let (row_scale, col_scale) = (scale_of(&rows)?, scale_of(&cols)?);
            let (q, qt) =
                match kernels::fp8_cast(&t, Fp8Scale::Rowwise { rows: &row_scale, cols: &col_scale }, e5m2, true)? {
                    Some((q, Some(qt), _)) => (q, qt),
                    _ => {
                        let wide = t.f_to_kind(Kind::Float)?;
                        let q = saturate(wide.f_mul(&row_scale.f_reshape([-1, 1])?)?)?;
                        (q, saturate(wide.f_mul(&col_scale)?)?.f_tr()?.f_contiguous()?)
                    }
                };
            let factor = |s: &Tensor| -> Result<Tensor> { Ok(s.f_reciprocal()?.f_reshape([-1, 1])?) };
            Ok(Cast { q, q_factor: factor(&row_scale)?, qt, qt_factor: factor(&col_scale)?, amax: None })
        }
        Scale::Given(_) | Scale::Current => {
            let (value, at, recorded) = match scale {
                Scale::Given(v) => (v, None, true),
                _ => (1.0, Some(scale_of(&t.f_norm_scalaropt_dtype(f64::INFINITY, Kind::Float)?)?), false),
            };
            let factor = match &at {
                Some(at) => at.f_reciprocal()?,
                // Filled on the device: a copy from the host would wait for the device.
                None => Tensor::f_full([], 1.0 / value, (Kind::Float, t.device()))?,
            };
            let on_device = match &at {
                Some(at) => Fp8Scale::At(at),
                None => Fp8Scale::Given(value),
            };
            let (q, qt, kernel_amax) = match kernels::fp8_cast(&t, on_device, e5m2, true)? {
                Some((q, Some(qt), amax)) => (q, qt, Some(amax)),
                _ => {
                    let scaled = match &at {
                        Some(at) => t.f_mul(at)?,
                        None => t.f_mul_scalar(value)?,
                    };
                    let q = saturate(scaled)?;
                    let qt = q.f_tr()?.f_contiguous()?;
                    (q, qt, None)
                }
            };
            // Delayed scaling records the tensor's maximum (the kernel takes it in its pass).
            let amax = match (recorded, kernel_amax) {
                (false, _) => None,
                (true, Some(amax)) => Some(amax),
                (true, None) => Some(t.f_norm_scalaropt_dtype(f64::INFINITY, Kind::Float)?),
            };
            Ok(Cast { q, q_factor: factor.shallow_clone(), qt, qt_factor: factor, amax })
        }
    }
}

/// `a @ b` of fp8 operands, `b` column-major, each multiplied back by its factors: floats
/// (tensorwise), or `[rows of a, 1]` and `[columns of b, 1]` (rowwise). `fast_accum` trades
/// accumulation precision for speed (Transformer Engine's choice for the forward product;
/// gradients accumulate exactly).
fn scaled_mm(a: &Tensor, fa: &Tensor, b: &Tensor, fb: &Tensor, out: Kind, fast_accum: bool) -> Result<Tensor> {
    // CUDA's kernels need every dimension a multiple of 16; the CPU's emulation does not, but
    // holding it to the same rule keeps CPU runs honest about what a GPU would accept.
    if let Some(d) = a.size().into_iter().chain(b.size()).find(|d| d % 16 != 0) {
        return Err(Error::Engine(format!("fp8 scaled products need dimensions that are multiples of 16, got {d}")));
    }
    if fa.dim() == 0 {
        return Ok(a.f_internal_scaled_mm::<Tensor>(b, fa, fb, None, None, out, fast_accum)?);
    }
    // Rowwise: `b`'s factors as a row, one per column of the product.
    let fb = fb.f_reshape([1, -1])?;
    if !a.device().is_cuda() {
        // The CPU has no rowwise scaled product: the same sum of exact fp8 products in fp32.
        let wide = |t: &Tensor, f: &Tensor| -> Result<Tensor> { Ok(t.f_to_kind(Kind::Float)?.f_mul(f)?) };
        return Ok(wide(a, fa)?.f_matmul(&wide(b, &fb)?)?.f_to_kind(out)?);
    }
    // libtorch's rowwise products write bf16 alone: other dtypes come from that.
    let product = a.f_internal_scaled_mm::<Tensor>(b, fa, &fb, None, None, Kind::BFloat16, fast_accum)?;
    Ok(product.f_to_kind(out)?)
}

/// One fp8 linear: forward and backward as scaled matrix products.
struct Fp8Linear {
    state: SharedFp8,
    slot: usize,
    /// Record amaxes (not when recomputing a forward already recorded).
    record: bool,
    out_kind: Kind,
    /// The bias's dtype, when there is one.
    bias_kind: Option<Kind>,
    /// Input, weight and gradient scales.
    scales: [Scale; 3],
    /// The transposed fp8 input and weight with their factors (`xᵀ`, its factors, `wᵀ`,
    /// its factors), and the dtypes of their gradients.
    saved: Option<([Tensor; 4], Kind, Kind)>,
}

impl strata_ext::Function for Fp8Linear {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let (x, w) = (&inputs[0], &inputs[1]);
        let [sx, sw, _] = self.scales;
        let x8 = cast(x, sx, Kind::Float8e4m3fn, E4M3_MAX).map_err(text)?;
        let w8 = {
            let mut s = self.state.lock().map_err(text)?;
            let w8 = match s.weights[self.slot].as_ref() {
                Some(cached) => cached.shallow_clone(),
                None => {
                    let fresh = cast(w, sw, Kind::Float8e4m3fn, E4M3_MAX).map_err(text)?;
                    s.weights[self.slot] = Some(fresh.shallow_clone());
                    fresh
                }
            };
            if let (true, Some(xa), Some(wa)) = (self.record, &x8.amax, &w8.amax) {
                s.observe(self.slot, Role::Input, xa).map_err(text)?;
                s.observe(self.slot, Role::Weight, wa).map_err(text)?;
            }
            w8
        };
        let mut out = scaled_mm(&x8.q, &x8.q_factor, &w8.q.tr(), &w8.q_factor, self.out_kind, true).map_err(text)?;
        if let Some(b) = inputs.get(2) {
            out = out.f_add(&b.f_to_kind(self.out_kind).map_err(text)?).map_err(text)?;
        }
        self.saved = Some(([x8.qt, x8.qt_factor, w8.qt, w8.qt_factor], x.kind(), w.kind()));
        Ok(vec![out])
    }

    /// With the transposes kept from forward (`xᵀ`, `wᵀ`, contiguous): the input's gradient
    /// `g @ w` (w column-major is `wᵀ` row-major) and the weight's `gᵀ @ x`.
    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let ([xt, xt_factor, wt, wt_factor], x_kind, w_kind) =
            self.saved.take().ok_or("fp8 linear: backward before forward")?;
        let g = &grads[0];
        let (grad_kind, grad_max) = self.state.lock().map_err(text)?.config.grad_format();
        let g8 = cast(g, self.scales[2], grad_kind, grad_max).map_err(text)?;
        if let Some(ga) = &g8.amax {
            self.state.lock().map_err(text)?.observe(self.slot, Role::Grad, ga).map_err(text)?;
        }
        let grad_x = scaled_mm(&g8.q, &g8.q_factor, &wt.tr(), &wt_factor, x_kind, false).map_err(text)?;
        let grad_w = scaled_mm(&g8.qt, &g8.qt_factor, &xt.tr(), &xt_factor, w_kind, false).map_err(text)?;
        let mut out = vec![grad_x, grad_w];
        if let Some(kind) = self.bias_kind {
            out.push(g.f_sum_dim_intlist(0, false, kind).map_err(text)?);
        }
        Ok(out)
    }
}

/// `x @ w.T + b` in fp8 for the `slot`-th fp8 linear of a unit; `out_kind` is the result's
/// dtype. Call order within a unit's forward must be the same every step.
pub fn linear(
    state: &SharedFp8,
    slot: usize,
    record: bool,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    out_kind: Kind,
) -> Result<Tensor> {
    let scales = {
        let mut s = state.lock().map_err(|e| Error::Engine(e.to_string()))?;
        while s.layers.len() <= slot {
            s.layers.push(LinearMeters { input: Meter::new(), weight: Meter::new(), grad: Meter::new() });
            s.observed.push(Default::default());
            s.weights.push(None);
        }
        let l = &s.layers[slot];
        match s.config.scaling {
            Fp8Scaling::Delayed => [l.input.scale, l.weight.scale, l.grad.scale].map(Scale::Given),
            Fp8Scaling::Current => [Scale::Current; 3],
            Fp8Scaling::Rowwise => [Scale::Rowwise; 3],
        }
    };
    let size = x.size();
    let k = *size.last().unwrap_or(&1);
    let x2 = x.f_reshape([-1, k])?;
    // Scaled products need every dimension a multiple of 16, the rows included (they are
    // the inner dimension of the weight gradient): zero rows pad them, which change no
    // product, no amax and no gradient, and are cut off again.
    let rows = x2.size()[0];
    let padding = (16 - rows % 16) % 16;
    let x2 = if padding > 0 { x2.f_constant_pad_nd([0, 0, 0, padding])? } else { x2 };
    let bias_kind = b.map(Tensor::kind);
    let f = Fp8Linear { state: state.clone(), slot, record, out_kind, bias_kind, scales, saved: None };
    let mut inputs = vec![&x2, w];
    if let Some(b) = b {
        inputs.push(b);
    }
    let out = strata_ext::apply_function(f, &inputs)?.remove(0).f_narrow(0, 0, rows)?;
    let mut shape = size[..size.len() - 1].to_vec();
    shape.push(w.size()[0]);
    Ok(out.f_reshape(shape)?)
}

#[cfg(test)]
mod tests {
    use super::Fp8Config;

    #[test]
    fn min_features_keeps_narrow_linears_out_of_fp8_and_says_which() {
        let config = Fp8Config { min_features: 2048, exclude: vec!["lm_head".into()], ..Default::default() };
        let (q, k, up, head) = ([2048, 2048], [512, 2048], [5632, 2048], [32000, 2048]);
        assert!(config.applies_to("q_proj.weight", &q) && config.applies_to("up_proj.weight", &up));
        assert!(!config.applies_to("k_proj.weight", &k), "512 output features");
        assert!(!config.applies_to("lm_head.weight", &head), "excluded by name");
        assert!(!config.applies_to("norm.weight", &[2048]), "not a matrix");
        let line = config.describe(&[
            ("q_proj.weight", &q),
            ("k_proj.weight", &k),
            ("up_proj.weight", &up),
            ("lm_head.weight", &head),
        ]);
        assert_eq!(line, "fp8: 2 of 3 linear weights; below 2048 features, in bf16: k_proj.weight [512, 2048]");
        assert!(Fp8Config { min_features: -1, ..Default::default() }.validate().is_err());
        assert!(Fp8Config::default().applies_to("k_proj.weight", &k), "no limit by default");
    }
}
