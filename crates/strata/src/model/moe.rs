//! Mixtures of experts: the sparse feed-forward of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
//! as part of a decoder block (or, Gemma 4's, beside its dense feed-forward), and the
//! load-balancing loss that trains their routers.
//!
//! Owns: the routing (softmax or sigmoid scores in fp32, DeepSeek-V3's choice bias and
//! group-limited choice, top-k, optional renormalisation and scaling), the experts'
//! computation over tokens grouped by expert, the shared expert (Qwen2-MoE's gated one, ERNIE 4.5's and
//! DeepSeek's plain ones), and
//! [`LoadBalance`], which gathers each sparse layer's routing over a forward and injects the
//! loss's gradient into each layer's backward. Must not own parameters or execution: the
//! decoder's model function declares the weights, the engine runs the units.
//!
//! The load-balancing loss (Switch Transformer's, as `transformers`' `load_balancing_loss_func`
//! computes it) couples every sparse layer: with `f_e` the share of all layers' token slots
//! routed to expert `e` (a token's top-k by its probabilities alone, where a choice bias
//! chooses others) and `P_e` the mean of its routing probability over all layers'
//! tokens, it is `E · Σ_e f_e · P_e`. `f` is not differentiable, so the loss is linear in
//! each layer's summed probabilities with one coefficient vector for all layers, known once
//! the forward has seen them all. A unit's graph ends at its own output (the engine runs
//! backward unit by unit), so each sparse layer passes its output through an identity node
//! whose backward adds that coefficient's gradient to the layer's probabilities: recomputed,
//! sharded or offloaded units take it in their own backward like any other gradient.
use super::layers::{geglu, grouped_linear, rms_normalized, swiglu};
use super::{ContextParallel, ExpertSlot, Init, ParamId, Params, TensorParallel, TpRole, UnitBuilder, INIT_STD};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::{Kind, Tensor};

/// The ranks that routed other parts of the same rows, whose routing sums join a rank's in
/// the load-balancing loss: a sequence-parallel tensor group, a context group.
#[derive(Clone, Copy, Default)]
pub struct RowSharers<'a> {
    /// The tensor group, under sequence parallel.
    pub sequence: Option<&'a dyn TensorParallel>,
    /// The context group, under context parallelism.
    pub context: Option<&'a dyn ContextParallel>,
}

impl RowSharers<'_> {
    /// `values` summed over every rank that routed a part of the same rows (this rank's
    /// alone where none did).
    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>> {
        let mut values = values.to_vec();
        if let Some(group) = self.sequence.filter(|g| g.size() > 1) {
            values = group.sum_values(&values)?;
        }
        if let Some(group) = self.context {
            values = group.sum_values(&values)?;
        }
        Ok(values)
    }
}

/// The expert group a sparse layer exchanges tokens over (expert parallelism): `size`
/// ranks, each computing the experts `[rank · E/size, (rank + 1) · E/size)` for the tokens
/// of every rank of the group. Implemented over a process group by `parallel`, so this layer
/// knows nothing of communication.
pub trait ExpertExchange: Send + Sync {
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Sends `inputs[r]` to rank `r` and returns what each rank sent this one, rank by rank
    /// (`received[r]` has `lengths[r]` rows of `inputs`' width). Every rank of the group
    /// calls it in the same order, with empty pieces where it has nothing to send.
    fn all_to_all(&self, inputs: &[Tensor], lengths: &[i64]) -> Result<Vec<Tensor>>;
    /// Every rank's `x` (of one shape on every rank), rank by rank: what the engine joins
    /// whole units from where each rank stores only its own experts.
    fn gather(&self, x: &Tensor) -> Result<Vec<Tensor>>;
    /// `values` summed over the group (squared gradient norms of experts stored apart).
    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>>;
}

impl std::fmt::Debug for dyn ExpertExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "expert group rank {} of {}", self.rank(), self.size())
    }
}

/// How an expert's feed-forward turns its gate and up projections (or its up projection
/// alone) into the down projection's input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertActivation {
    /// SwiGLU, `silu(gate) · up`.
    #[default]
    Silu,
    /// gpt-oss's: the gate clamped above at `limit`, the up projection within ± `limit`,
    /// then `(up + 1) · gate · sigmoid(alpha · gate)` (`swiglu_alpha`, `swiglu_limit`).
    ClampedSwiglu {
        /// The sigmoid's slope.
        alpha: f64,
        /// The clamp.
        limit: f64,
    },
    /// GeGLU with GELU's tanh form, `gelu_tanh(gate) · up` (Gemma 4).
    GeluTanh,
    /// `relu(up)²` without a gate projection (Nemotron-H's experts and shared expert).
    UngatedRelu2,
}

impl ExpertActivation {
    /// Whether the experts have a gate projection.
    pub fn gated(self) -> bool {
        self != ExpertActivation::UngatedRelu2
    }
}

/// How a family names its experts' weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertNames {
    /// `mlp.gate.weight` and `mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen2/3-MoE, OLMoE).
    #[default]
    Mlp,
    /// `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w{1,3,2}.weight`
    /// (Mixtral: `w1` the gate, `w3` the up and `w2` the down projection).
    BlockSparse,
    /// `mlp.router.weight` and the experts stacked in one tensor per projection on disk
    /// (gpt-oss: `mlp.experts.gate_up_proj` `[E, D, 2F]` with gate and up columns
    /// interleaved, `mlp.experts.down_proj` `[E, F, D]`, and their biases); each expert's
    /// weights are `mlp.experts.{e}.{gate,up,down}_proj.weight` here.
    Stacked,
    /// `router.proj.weight` (with `router.scale` and `router.per_expert_scale`) and
    /// `experts.{e}.{gate,up,down}_proj.weight` under the layer itself, beside its `mlp`
    /// (Gemma 4, whose files stack the experts as `experts.gate_up_proj` `[E, 2F, D]` and
    /// `experts.down_proj` `[E, D, F]`).
    Layer,
    /// [`ExpertNames::Mlp`]'s, the choice bias `mlp.moe_statics.e_score_correction_bias`
    /// `[1, E]` (ERNIE 4.5's).
    MlpStatics,
    /// `block_sparse_moe.router.layer.weight` and the experts stacked on disk as
    /// `block_sparse_moe.input_linear.weight` `[E, 2F, D]` (the gate's rows, then the up's)
    /// and `block_sparse_moe.output_linear.weight` `[E, D, F]` (Granite-MoE); each expert's
    /// weights are `block_sparse_moe.experts.{e}.{gate,up,down}_proj.weight` here.
    InputOutputLinear,
    /// `feed_forward.router.weight`, `feed_forward.shared_expert.{gate,up,down}_proj.weight`
    /// and the experts stacked input-major on disk as `feed_forward.experts.gate_up_proj`
    /// `[E, D, 2F]` (the gate's columns, then the up's) and `feed_forward.experts.down_proj`
    /// `[E, F, D]` (Llama 4); each expert's weights are
    /// `feed_forward.experts.{e}.{gate,up,down}_proj.weight` here.
    FeedForward,
    /// [`ExpertNames::Mlp`]'s experts, the router `mlp.gate.wg.weight` and the shared expert
    /// `mlp.shared_mlp.{gate,up,down}_proj.weight` (HunYuan-MoE).
    SharedMlp,
    /// `feed_forward.gate.weight`, `feed_forward.experts.{e}.w{1,3,2}.weight` (Mixtral's
    /// order: gate, up, down) and the choice bias `feed_forward.expert_bias` (LFM2-MoE).
    FeedForwardW,
}

/// How a router turns its logits into the scores it chooses and weights experts by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scoring {
    /// A softmax over the experts (Mixtral, Qwen-MoE, OLMoE).
    #[default]
    Softmax,
    /// Each expert's own sigmoid (DeepSeek-V3, GLM-4.5).
    Sigmoid,
}

/// How a group of experts is scored when tokens choose groups before experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupScore {
    /// The sum of the group's two best choice scores (DeepSeek-V3's `noaux_tc`).
    #[default]
    TopTwoSum,
    /// The group's best score (DeepSeek-V2's `group_limited_greedy`).
    Best,
}

/// A decoder's mixture of experts, as its `config.json` describes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts in each sparse layer.
    pub experts: i64,
    /// Experts each token is sent to.
    pub top_k: i64,
    /// Hidden width of each expert's gated feed-forward.
    pub expert_ffn_dim: i64,
    /// The top-k routing weights renormalised to sum to one (`norm_topk_prob`).
    pub norm_topk: bool,
    /// Hidden width of a shared expert every token passes through; `None`: no shared expert.
    #[serde(default)]
    pub shared_expert_dim: Option<i64>,
    /// The shared expert's output is scaled by a sigmoid gate of its own (Qwen2-MoE's
    /// `shared_expert` and `shared_expert_gate`) rather than added as it is (DeepSeek's
    /// `shared_experts`, their widths joined into one).
    #[serde(default = "gated")]
    pub shared_gate: bool,
    /// How the router scores the experts.
    #[serde(default)]
    pub scoring: Scoring,
    /// A bias on the router's logits (gpt-oss).
    #[serde(default)]
    pub router_bias: bool,
    /// Biases on each expert's projections (gpt-oss).
    #[serde(default)]
    pub expert_bias: bool,
    /// How each expert gates.
    #[serde(default)]
    pub activation: ExpertActivation,
    /// A bias per expert added to the scores to choose experts, but not to weight them
    /// (DeepSeek-V3's `e_score_correction_bias`): it takes no gradient, and moves only by
    /// `bias_update_rate`.
    #[serde(default)]
    pub choice_bias: bool,
    /// Auxiliary-loss-free balancing (DeepSeek-V3's): after each optimizer step, each
    /// layer's choice bias moves by this rate towards its underloaded experts,
    /// `b_e += rate · sign(mean load − load_e)`, the loads counted over the step's tokens on
    /// every rank. 0 (the default, and what fine-tuning usually wants): the bias stays as
    /// loaded. Needs `choice_bias`.
    #[serde(default)]
    pub bias_update_rate: f64,
    /// The experts fall into this many equal groups and each token chooses among the
    /// `top_groups` groups that score highest by `group_score` (`n_group`, `topk_group`);
    /// 1: no grouping.
    #[serde(default = "one")]
    pub groups: i64,
    /// Groups each token chooses its experts from (`topk_group`).
    #[serde(default = "one")]
    pub top_groups: i64,
    /// How a group is scored where there are groups.
    #[serde(default)]
    pub group_score: GroupScore,
    /// The routing weights are multiplied by this (`routed_scaling_factor`).
    #[serde(default = "unit_scale")]
    pub routed_scale: f64,
    /// What the renormalisation adds to the sum it divides by (1e-20, DeepSeek's; LFM2-MoE's
    /// 1e-6).
    #[serde(default = "renormalisation_epsilon")]
    pub norm_topk_epsilon: f64,
    /// Which layers are sparse: layer `i` is when `(i + 1) % sparse_step == 0` and `i` is
    /// not in `dense_layers` (`decoder_sparse_step`, `mlp_only_layers`).
    #[serde(default = "every_layer")]
    pub sparse_step: i64,
    /// Layers kept dense whatever `sparse_step` says (`mlp_only_layers`).
    #[serde(default)]
    pub dense_layers: Vec<i64>,
    /// The load-balancing loss's weight in the training loss (`router_aux_loss_coef`); 0
    /// trains without it.
    #[serde(default)]
    pub aux_loss_coef: f64,
    /// The router z-loss's weight (ST-MoE's): `coef ·` the mean over tokens of
    /// `logsumexp(router logits)²`, summed over sparse layers; 0 trains without it.
    #[serde(default)]
    pub z_loss_coef: f64,
    /// Each expert takes at most `⌈factor · tokens · top_k / E⌉` of a layer's token slots
    /// (of the tokens this rank routes), those with the highest routing weights; the others
    /// are dropped (they add nothing to their token's output). `None`: none is dropped.
    #[serde(default)]
    pub capacity_factor: Option<f64>,
    /// How the family names the experts' weights.
    #[serde(default)]
    pub names: ExpertNames,
    /// The router reads the residual stream RMS-normed without a weight, times a learned
    /// scale per dimension (`router.scale`) and `dim^-1/2` (Gemma 4).
    #[serde(default)]
    pub router_norm: bool,
    /// Each routing weight, after any renormalisation, times a learned scale of its expert
    /// (`router.per_expert_scale`, Gemma 4).
    #[serde(default)]
    pub expert_scales: bool,
    /// The experts run beside the dense feed-forward rather than in its place, each with
    /// norms of its own before the two are summed (Gemma 4's `enable_moe_block`).
    #[serde(default)]
    pub beside_dense: bool,
    /// Each routing weight scales its expert's input rather than its output (Llama 4's).
    #[serde(default)]
    pub scale_inputs: bool,
    /// The load-balancing loss reads a softmax of the router's logits, and counts each
    /// token's top-k of it, whatever scores route the tokens (MiniMax-M2's class computes
    /// Mixtral's loss so beside its sigmoid router).
    #[serde(default)]
    pub balance_over_softmax: bool,
    /// The routed experts work in a narrower space: each token enters it through
    /// `fc1_latent_proj` (`[latent, dim]`), its experts' weighted sum leaves it through
    /// `fc2_latent_proj` (`[dim, latent]`); the router and the shared expert read the hidden
    /// states themselves (Nemotron-H's `moe_latent_size`). `None`: no latent space.
    #[serde(default)]
    pub latent_dim: Option<i64>,
}

fn every_layer() -> i64 {
    1
}

fn one() -> i64 {
    1
}

fn renormalisation_epsilon() -> f64 {
    1e-20
}

fn unit_scale() -> f64 {
    1.0
}

fn gated() -> bool {
    true
}

impl MoeConfig {
    /// `experts` experts `expert_ffn_dim` wide, `top_k` of them per token, softmax scores
    /// not renormalised, every layer sparse, no shared expert, no auxiliary loss.
    pub fn new(experts: i64, top_k: i64, expert_ffn_dim: i64) -> MoeConfig {
        MoeConfig {
            experts,
            top_k,
            expert_ffn_dim,
            norm_topk: false,
            shared_expert_dim: None,
            shared_gate: true,
            scoring: Scoring::Softmax,
            router_bias: false,
            expert_bias: false,
            activation: ExpertActivation::Silu,
            choice_bias: false,
            bias_update_rate: 0.0,
            groups: 1,
            top_groups: 1,
            group_score: GroupScore::TopTwoSum,
            routed_scale: 1.0,
            norm_topk_epsilon: renormalisation_epsilon(),
            sparse_step: 1,
            dense_layers: vec![],
            aux_loss_coef: 0.0,
            z_loss_coef: 0.0,
            capacity_factor: None,
            names: ExpertNames::Mlp,
            router_norm: false,
            expert_scales: false,
            beside_dense: false,
            scale_inputs: false,
            balance_over_softmax: false,
            latent_dim: None,
        }
    }

    /// Whether decoder layer `layer` has experts rather than a dense feed-forward.
    pub fn is_sparse(&self, layer: i64) -> bool {
        (layer + 1) % self.sparse_step == 0 && !self.dense_layers.contains(&layer)
    }

    /// Fails with the first value out of range: a size that is not positive, `top_k` above
    /// `experts`, a negative loss weight, a capacity factor that is not positive.
    pub fn validate(&self) -> Result<()> {
        super::positive(&[
            ("num_experts", self.experts),
            ("num_experts_per_tok", self.top_k),
            ("moe_intermediate_size", self.expert_ffn_dim),
            ("decoder_sparse_step", self.sparse_step),
        ])?;
        if self.top_k > self.experts {
            return Err(Error::Config(format!(
                "num_experts_per_tok {} is more than the {} experts",
                self.top_k, self.experts
            )));
        }
        if let Some(d) = self.shared_expert_dim.filter(|&d| d <= 0) {
            return Err(Error::Config(format!("shared_expert_intermediate_size must be positive, got {d}")));
        }
        if !(self.aux_loss_coef.is_finite() && self.aux_loss_coef >= 0.0) {
            return Err(Error::Config(format!("router_aux_loss_coef must be 0 or more, got {}", self.aux_loss_coef)));
        }
        if !(self.z_loss_coef.is_finite() && self.z_loss_coef >= 0.0) {
            return Err(Error::Config(format!(
                "the router z-loss's weight must be 0 or more, got {}",
                self.z_loss_coef
            )));
        }
        if !(self.bias_update_rate.is_finite() && self.bias_update_rate >= 0.0) {
            return Err(Error::Config(format!(
                "the choice bias's update rate must be 0 or more, got {}",
                self.bias_update_rate
            )));
        }
        if self.bias_update_rate > 0.0 && !self.choice_bias {
            return Err(Error::Config(
                "the choice bias's update moves DeepSeek-style routing's e_score_correction_bias: \
                 this model's router has none"
                    .into(),
            ));
        }
        if let Some(latent) = self.latent_dim.filter(|&l| l <= 0) {
            return Err(Error::Config(format!("moe_latent_size must be positive, got {latent}")));
        }
        if self.expert_bias && !self.activation.gated() {
            return Err(Error::Config("biases on the experts' projections take gated experts".into()));
        }
        if let Some(f) = self.capacity_factor.filter(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(Error::Config(format!("the experts' capacity factor must be positive, got {f}")));
        }
        if let ExpertActivation::ClampedSwiglu { alpha, limit } = self.activation {
            if !(alpha.is_finite() && limit.is_finite() && alpha > 0.0 && limit > 0.0) {
                return Err(Error::Config(format!(
                    "swiglu_alpha and swiglu_limit must be positive, got {alpha} and {limit}"
                )));
            }
        }
        if !(self.routed_scale.is_finite() && self.routed_scale > 0.0) {
            return Err(Error::Config(format!("routed_scaling_factor must be positive, got {}", self.routed_scale)));
        }
        self.check_groups()
    }

    /// Group-limited routing fits: groups divide the experts, each holds two where its
    /// score is its two best, no more groups are chosen than exist and they hold `top_k`
    /// experts.
    fn check_groups(&self) -> Result<()> {
        let (groups, top) = (self.groups, self.top_groups);
        if groups <= 0 || top <= 0 || top > groups {
            return Err(Error::Config(format!(
                "topk_group {top} must lie between 1 and n_group {groups} (which must be positive)"
            )));
        }
        if groups > 1 {
            let least = match self.group_score {
                GroupScore::TopTwoSum => 2,
                GroupScore::Best => 1,
            };
            if self.experts % groups != 0 || self.experts / groups < least {
                return Err(Error::Config(format!(
                    "n_group {groups} must split the {} experts into groups of {least} or more",
                    self.experts
                )));
            }
            if top * (self.experts / groups) < self.top_k {
                return Err(Error::Config(format!(
                    "topk_group {top} groups of {} experts hold fewer than num_experts_per_tok {}",
                    self.experts / groups,
                    self.top_k
                )));
            }
        }
        Ok(())
    }

    /// The names of the shared expert's gate, up and down weights in sparse layer `layer`,
    /// and of its gate's weight where it has one.
    pub fn shared_names(&self, layer: &str) -> ([String; 3], Option<String>) {
        let module = match (self.names, self.shared_gate) {
            (ExpertNames::FeedForward, _) => "feed_forward.shared_expert",
            (ExpertNames::SharedMlp, _) => "mlp.shared_mlp",
            (_, true) => "mlp.shared_expert",
            _ => "mlp.shared_experts",
        };
        let names = ["gate_proj", "up_proj", "down_proj"].map(|w| format!("{layer}.{module}.{w}.weight"));
        (names, self.shared_gate.then(|| format!("{layer}.mlp.shared_expert_gate.weight")))
    }

    /// The names of a sparse layer's router and of expert `e`'s gate, up and down weights.
    pub fn router_name(&self, layer: &str) -> String {
        match self.names {
            ExpertNames::Mlp | ExpertNames::MlpStatics => format!("{layer}.mlp.gate.weight"),
            ExpertNames::Layer => format!("{layer}.router.proj.weight"),
            ExpertNames::Stacked => format!("{layer}.mlp.router.weight"),
            ExpertNames::BlockSparse => format!("{layer}.block_sparse_moe.gate.weight"),
            ExpertNames::InputOutputLinear => format!("{layer}.block_sparse_moe.router.layer.weight"),
            ExpertNames::FeedForward => format!("{layer}.feed_forward.router.weight"),
            ExpertNames::SharedMlp => format!("{layer}.mlp.gate.wg.weight"),
            ExpertNames::FeedForwardW => format!("{layer}.feed_forward.gate.weight"),
        }
    }

    /// The names of expert `e`'s gate, up and down weights in sparse layer `layer`.
    pub fn expert_names(&self, layer: &str, e: i64) -> [String; 3] {
        match self.names {
            ExpertNames::Mlp | ExpertNames::MlpStatics | ExpertNames::Stacked | ExpertNames::SharedMlp => {
                ["gate_proj", "up_proj", "down_proj"].map(|w| format!("{layer}.mlp.experts.{e}.{w}.weight"))
            }
            ExpertNames::BlockSparse => {
                ["w1", "w3", "w2"].map(|w| format!("{layer}.block_sparse_moe.experts.{e}.{w}.weight"))
            }
            ExpertNames::FeedForwardW => {
                ["w1", "w3", "w2"].map(|w| format!("{layer}.feed_forward.experts.{e}.{w}.weight"))
            }
            ExpertNames::Layer => {
                ["gate_proj", "up_proj", "down_proj"].map(|w| format!("{layer}.experts.{e}.{w}.weight"))
            }
            ExpertNames::InputOutputLinear => ["gate_proj", "up_proj", "down_proj"]
                .map(|w| format!("{layer}.block_sparse_moe.experts.{e}.{w}.weight")),
            ExpertNames::FeedForward => {
                ["gate_proj", "up_proj", "down_proj"].map(|w| format!("{layer}.feed_forward.experts.{e}.{w}.weight"))
            }
        }
    }

    /// The module holding sparse layer `layer`'s experts, as peft's `target_parameters`
    /// names it.
    pub fn experts_module(&self, layer: &str) -> String {
        match self.names {
            ExpertNames::Layer => format!("{layer}.experts"),
            ExpertNames::InputOutputLinear => format!("{layer}.block_sparse_moe.experts"),
            ExpertNames::FeedForward | ExpertNames::FeedForwardW => format!("{layer}.feed_forward.experts"),
            _ => format!("{layer}.mlp.experts"),
        }
    }
}

/// One expert's feed-forward: `down(act(gate(x), up(x)))`, or `down(act(up(x)))` without
/// a gate, with optional biases.
#[derive(Clone, Copy)]
pub(crate) struct Expert {
    /// `None` where the experts have no gate ([`ExpertActivation::gated`]).
    pub(crate) gate: Option<ParamId>,
    pub(crate) up: ParamId,
    pub(crate) down: ParamId,
    /// The gate's, up's and down's biases, where the family has them.
    biases: Option<[ParamId; 3]>,
    activation: ExpertActivation,
}

impl Expert {
    /// Declares an expert's gate (where it has one), up and down weights (named `names`, `width` wide, over
    /// hidden states `dim` wide): routed expert `slot`'s, or a shared expert's (`None`). A
    /// shared expert's are linear layers a LoRA strategy's `target_modules` may name; routed
    /// experts' are not (`transformers` stacks them into one module's parameters, which
    /// `target_parameters` names: [`super::ExpertSet`]).
    pub(crate) fn declare(
        u: &mut UnitBuilder<'_>,
        names: [String; 3],
        width: i64,
        dim: i64,
        slot: Option<ExpertSlot>,
        moe: &MoeConfig,
    ) -> Expert {
        let normal = Init::Normal { std: INIT_STD };
        let mut param = |name: &str, shape: &[i64], init: Init| match slot {
            Some(slot) => u.expert_param(name, shape, init, slot),
            None => u.linear(name, shape, init, TpRole::SequenceReplicated),
        };
        // A shared expert gates with SwiGLU, or runs without a gate as the routed ones do.
        let activation = match slot {
            Some(_) => moe.activation,
            None if !moe.activation.gated() => moe.activation,
            None => ExpertActivation::Silu,
        };
        let gate = activation.gated().then(|| param(&names[0], &[width, dim], normal));
        let [up, down] =
            [(&names[1], [width, dim]), (&names[2], [dim, width])].map(|(name, shape)| param(name, &shape, normal));
        // Each bias beside its weight, named as the weight is but `.bias` (validated: gated
        // experts alone carry biases).
        let biases = (slot.is_some() && moe.expert_bias).then(|| {
            [(&names[0], width), (&names[1], width), (&names[2], dim)].map(|(name, out)| {
                let name = name.strip_suffix(".weight").unwrap_or(name);
                param(&format!("{name}.bias"), &[out], Init::Zeros)
            })
        });
        Expert { gate, up, down, biases, activation }
    }

    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let [gate_bias, up_bias, down_bias] = self.biases.map_or([None; 3], |b| b.map(Some));
        let up = p.linear(x, self.up, up_bias)?;
        let Some(gate) = self.gate else {
            return p.linear(&up.f_relu()?.f_square()?, self.down, down_bias);
        };
        let gate = p.linear(x, gate, gate_bias)?;
        let gated = match self.activation {
            ExpertActivation::Silu => swiglu(&gate, &up)?,
            ExpertActivation::ClampedSwiglu { alpha, limit } => {
                let gate = gate.f_clamp_max(limit)?;
                let up = up.f_clamp(-limit, limit)?;
                up.f_add_scalar(1.0)?.f_mul(&gate.f_mul(&gate.f_mul_scalar(alpha)?.f_sigmoid()?)?)?
            }
            ExpertActivation::GeluTanh => geglu(&gate, &up)?,
            ExpertActivation::UngatedRelu2 => return Err(Error::Model("relu² experts have no gate".into())),
        };
        p.linear(&gated, self.down, down_bias)
    }
}

/// A sparse layer's router: its weight, how it scores and chooses, and how it weights the
/// experts it chose.
pub(crate) struct Router {
    weight: ParamId,
    bias: Option<ParamId>,
    choice_bias: Option<ParamId>,
    /// The scale per dimension of the normed input, and the norm's epsilon, where the
    /// router norms its input.
    input_norm: Option<(ParamId, f64)>,
    /// Each expert's scale of its routing weights.
    expert_scales: Option<ParamId>,
    scoring: Scoring,
    top_k: i64,
    norm_topk: bool,
    groups: i64,
    top_groups: i64,
    group_score: GroupScore,
    scale: f64,
    norm_epsilon: f64,
    balance_over_softmax: bool,
}

/// A sparse layer's feed-forward: the router, the routed experts and an optional shared
/// expert with its optional gate.
pub(crate) struct SparseFeedForward {
    router: Router,
    experts: Vec<Expert>,
    shared: Option<(Expert, Option<ParamId>)>,
    /// The projections into and out of the routed experts' latent space, where they have one.
    latent: Option<(ParamId, ParamId)>,
    capacity_factor: Option<f64>,
    /// The routing weights scale the experts' inputs rather than their outputs.
    scale_inputs: bool,
    /// This layer's place among the model's sparse layers, and the model's balance.
    layer: usize,
    balance: Arc<LoadBalance>,
}

impl SparseFeedForward {
    /// Declares sparse layer `name`'s router, experts and shared expert over hidden states
    /// `dim` wide, as `moe` names them; `layer` is its place among the sparse layers, `eps`
    /// the epsilon of a router's norm.
    pub(crate) fn declare(
        u: &mut UnitBuilder<'_>,
        moe: &MoeConfig,
        name: &str,
        (dim, eps): (i64, f64),
        layer: usize,
        balance: &Arc<LoadBalance>,
    ) -> SparseFeedForward {
        let normal = Init::Normal { std: INIT_STD };
        let router = moe.router_name(name);
        let weight = u.param(router.clone(), &[moe.experts, dim], normal, TpRole::SequenceReplicated);
        // The router's other tensors, beside its weight under the family's module name.
        let module = router.strip_suffix(".weight").unwrap_or(&router);
        let bias = moe
            .router_bias
            .then(|| u.param(format!("{module}.bias"), &[moe.experts], Init::Zeros, TpRole::SequenceReplicated));
        let choice_bias = moe.choice_bias.then(|| {
            let (bias, shape) = match moe.names {
                ExpertNames::MlpStatics => {
                    (format!("{name}.mlp.moe_statics.e_score_correction_bias"), vec![1, moe.experts])
                }
                // Beside the router, under the block (MiniMax-M2's).
                ExpertNames::BlockSparse => {
                    (format!("{name}.block_sparse_moe.e_score_correction_bias"), vec![moe.experts])
                }
                ExpertNames::FeedForwardW => (format!("{name}.feed_forward.expert_bias"), vec![moe.experts]),
                _ => (format!("{module}.e_score_correction_bias"), vec![moe.experts]),
            };
            let id = u.frozen_param(bias, &shape, Init::Zeros, TpRole::Replicated);
            balance.hold_choice_bias(layer, id);
            id
        });
        // Gemma 4's router module holds its projection (`router.proj`) and its scales.
        let scales = module.strip_suffix(".proj").unwrap_or(module);
        let input_norm = moe
            .router_norm
            .then(|| (u.param(format!("{scales}.scale"), &[dim], Init::Ones, TpRole::SequenceReplicated), eps));
        let expert_scales = moe.expert_scales.then(|| {
            u.param(format!("{scales}.per_expert_scale"), &[moe.experts], Init::Ones, TpRole::SequenceReplicated)
        });
        let latent = moe.latent_dim.map(|width| {
            let projection = |u: &mut UnitBuilder<'_>, which: &str, shape: [i64; 2]| {
                u.linear(format!("{name}.mlp.{which}_latent_proj.weight"), &shape, normal, TpRole::SequenceReplicated)
            };
            (projection(u, "fc1", [width, dim]), projection(u, "fc2", [dim, width]))
        });
        let experts: Vec<Expert> = (0..moe.experts)
            .map(|e| {
                Expert::declare(
                    u,
                    moe.expert_names(name, e),
                    moe.expert_ffn_dim,
                    moe.latent_dim.unwrap_or(dim),
                    Some(ExpertSlot { index: e, of: moe.experts }),
                    moe,
                )
            })
            .collect();
        u.expert_set(super::ExpertSet {
            module: moe.experts_module(name),
            gate: experts.iter().filter_map(|e| e.gate).collect(),
            up: experts.iter().map(|e| e.up).collect(),
            down: experts.iter().map(|e| e.down).collect(),
            top_k: moe.top_k,
            // gpt-oss's and Llama 4's stacks are input-major, peft's adapters of them alike;
            // experts without a gate stack no `gate_up_proj`.
            peft_layout: moe.activation.gated()
                && !matches!(moe.names, ExpertNames::Stacked | ExpertNames::FeedForward),
        });
        let shared = moe.shared_expert_dim.map(|width| {
            let (names, gate) = moe.shared_names(name);
            let expert = Expert::declare(u, names, width, dim, None, moe);
            (expert, gate.map(|gate| u.linear(gate, &[1, dim], normal, TpRole::SequenceReplicated)))
        });
        SparseFeedForward {
            router: Router {
                weight,
                bias,
                choice_bias,
                input_norm,
                expert_scales,
                scoring: moe.scoring,
                top_k: moe.top_k,
                norm_topk: moe.norm_topk,
                groups: moe.groups,
                top_groups: moe.top_groups,
                group_score: moe.group_score,
                scale: moe.routed_scale,
                norm_epsilon: moe.norm_topk_epsilon,
                balance_over_softmax: moe.balance_over_softmax,
            },
            experts,
            shared,
            latent,
            capacity_factor: moe.capacity_factor,
            scale_inputs: moe.scale_inputs,
            layer,
            balance: Arc::clone(balance),
        }
    }
}

/// Where each token went: its experts `[N, k]` and their weights `[N, k]` (fp32), with the
/// routing probabilities `[N, E]` the load-balancing loss reads and, where the router z-loss
/// is trained, the sum over tokens of `logsumexp(logits)²`; both, and the token counts,
/// leave out padding (`real`: 1 for a token, 0 for padding, `[N]` fp32, where rows are
/// padded).
struct Routing {
    experts: Tensor,
    weights: Tensor,
    probs: Tensor,
    /// Each token's top `k` experts by its probabilities alone, where a choice bias chose
    /// others: what the load-balancing loss counts, as `transformers`' does.
    counted: Option<Tensor>,
    z_sum: Option<Tensor>,
    real: Option<Tensor>,
}

/// What the experts did with a layer's token slots: the slots sent to experts on other
/// ranks and those dropped past an expert's capacity.
struct Dispatch {
    remote: i64,
    dropped: i64,
}

impl Router {
    /// `choice` `[N, E]` with the experts outside each token's `top_groups` best groups
    /// set to -inf, the groups scored by the router's `group_score`.
    fn within_chosen_groups(&self, choice: &Tensor) -> Result<Tensor> {
        let (n, experts) = (choice.size()[0], choice.size()[1]);
        let grouped = choice.f_reshape([n, self.groups, experts / self.groups])?;
        let group_scores = match self.group_score {
            GroupScore::TopTwoSum => grouped.f_topk(2, -1, true, true)?.0.f_sum_dim_intlist(-1, false, Kind::Float)?,
            GroupScore::Best => grouped.f_amax(-1, false)?,
        };
        let chosen = group_scores.f_topk(self.top_groups, -1, true, false)?.1;
        let kept = Tensor::f_zeros([n, self.groups], (Kind::Bool, choice.device()))?.f_scatter_value(1, &chosen, 1)?;
        let kept = kept.f_unsqueeze(-1)?.f_expand_as(&grouped)?.f_reshape([n, experts])?;
        Ok(choice.f_masked_fill(&kept.f_logical_not()?, f64::NEG_INFINITY)?)
    }
}

impl SparseFeedForward {
    /// The feed-forward of the normed hidden states `h` `[B, T, D]`, routed by `routed_by`
    /// (of the same shape) where the router reads other states than the experts (Gemma 4's
    /// the residual stream), else by `h`.
    pub(crate) fn forward(&self, p: &Params<'_>, h: &Tensor, routed_by: Option<&Tensor>) -> Result<Tensor> {
        let size = h.size();
        let dim = *size.last().ok_or_else(|| Error::Model("a sparse feed-forward of a scalar".into()))?;
        let x = h.f_reshape([-1, dim])?;
        let router_input = match routed_by {
            Some(r) => r.f_reshape([-1, dim])?,
            None => x.shallow_clone(),
        };
        let routing = self.route(p, &router_input, real_tokens(p, &size)?)?;
        let (mut y, dispatch) = match self.latent {
            Some((into, out_of)) => {
                let (y, dispatch) = self.experts_of(p, &p.linear(&x, into, None)?, &routing)?;
                (p.linear(&y, out_of, None)?, dispatch)
            }
            None => self.experts_of(p, &x, &routing)?,
        };
        if let Some((expert, gate)) = &self.shared {
            let shared = expert.forward(p, &x)?;
            y = match gate {
                Some(gate) => y.f_add(&shared.f_mul(&p.linear(&x, *gate, None)?.f_sigmoid()?)?)?,
                None => y.f_add(&shared)?,
            };
        }
        let y = self.balance.attach(self.layer, &y, &routing, dispatch)?;
        Ok(y.f_reshape(size.as_slice())?)
    }

    /// Scores in fp32, the top `k` experts of each token and their weights: the experts
    /// are chosen by their scores plus the choice bias (where there is one) within the
    /// chosen groups (where they are grouped), and weighted by their scores alone,
    /// renormalised where asked, times the routed scale.
    fn route(&self, p: &Params<'_>, x: &Tensor, real: Option<Tensor>) -> Result<Routing> {
        let r = &self.router;
        let x = x.f_to_kind(Kind::Float)?;
        let x = match r.input_norm {
            Some((scale, eps)) => {
                let root = (x.size()[1] as f64).powf(-0.5);
                rms_normalized(&x, eps)?.f_mul(&p[scale].f_to_kind(Kind::Float)?)?.f_mul_scalar(root)?
            }
            None => x,
        };
        let logits = x.f_matmul(&p[r.weight].f_to_kind(Kind::Float)?.f_tr()?)?;
        let logits = match r.bias {
            Some(bias) => logits.f_add(&p[bias].f_to_kind(Kind::Float)?)?,
            None => logits,
        };
        let probs = match r.scoring {
            Scoring::Softmax => logits.f_softmax(-1, Kind::Float)?,
            Scoring::Sigmoid => logits.f_sigmoid()?,
        };
        let choice = match r.choice_bias {
            Some(bias) => probs.f_add(&p[bias].f_to_kind(Kind::Float)?)?,
            None => probs.shallow_clone(),
        };
        let choice = if r.groups > 1 { r.within_chosen_groups(&choice)? } else { choice };
        let experts = choice.f_topk(r.top_k, -1, true, true)?.1;
        let mut weights = probs.f_gather(-1, &experts, false)?;
        if r.norm_topk {
            weights =
                weights.f_div(&weights.f_sum_dim_intlist(-1, true, Kind::Float)?.f_add_scalar(r.norm_epsilon)?)?;
        }
        if r.scale != 1.0 {
            weights = weights.f_mul_scalar(r.scale)?;
        }
        if let Some(scales) = r.expert_scales {
            weights = weights.f_mul(
                &p[scales].f_to_kind(Kind::Float)?.f_index_select(0, &experts.f_reshape([-1])?)?.f_view_as(&experts)?,
            )?;
        }
        let z_sum = match self.balance.z_coef > 0.0 {
            true => {
                let squares = logits.f_logsumexp([-1], false)?.f_square()?;
                let squares = match &real {
                    Some(real) => squares.f_mul(real)?,
                    None => squares,
                };
                Some(squares.f_sum(Kind::Float)?)
            }
            false => None,
        };
        // What the load-balancing loss reads: the scores, or a softmax of the logits beside
        // sigmoid scores where the family's class computes it so (MiniMax-M2's).
        let balanced = match (r.balance_over_softmax, r.scoring) {
            (true, Scoring::Sigmoid) => logits.f_softmax(-1, Kind::Float)?,
            _ => probs,
        };
        // Each token's top-k of those, where the choice is made otherwise: by softmax scores
        // plus a choice bias (ERNIE 4.5) or by sigmoid scores beside a softmax loss, as
        // transformers' load_balancing_loss_func counts them. Sigmoid routers with a loss
        // of their own scores (DeepSeek's, with no such loss in transformers) count the
        // experts chosen.
        let counted = match (r.choice_bias, r.scoring, r.balance_over_softmax) {
            (Some(_), Scoring::Softmax, _) | (_, Scoring::Sigmoid, true) => {
                Some(balanced.f_topk(r.top_k, -1, true, true)?.1)
            }
            _ => None,
        };
        Ok(Routing { experts, weights, probs: balanced, counted, z_sum, real })
    }

    /// The routed experts' weighted sum for every token: token slots grouped by expert, each
    /// group through its expert in one product (on the rank computing that expert, where
    /// experts are split over an expert group), then summed per token in fp32 in the order
    /// of its top-k slots, so the result does not depend on how tokens were grouped. Past
    /// an expert's capacity (where there is one), its slots of lowest weight are dropped.
    fn experts_of(&self, p: &Params<'_>, x: &Tensor, routing: &Routing) -> Result<(Tensor, Dispatch)> {
        let (k, experts) = (self.router.top_k, self.experts.len() as i64);
        let slots = routing.experts.f_reshape([-1])?;
        let counts = slots.f_bincount::<Tensor>(None, experts)?;
        let (order, counts, dropped) = match self.capacity_factor {
            None => (slots.f_argsort_stable(true, 0, false)?, counts, 0),
            Some(factor) => {
                let capacity = (factor * (x.size()[0] * k) as f64 / experts as f64).ceil() as i64;
                // By expert, and within an expert by weight, heaviest first, padding's slots
                // last (they would otherwise push real tokens out); the first `capacity` of
                // each expert's slots are kept.
                let key = match &routing.real {
                    Some(real) => {
                        routing.weights.f_masked_fill(&real.f_unsqueeze(-1)?.f_eq(0.0)?, f64::NEG_INFINITY)?
                    }
                    None => routing.weights.shallow_clone(),
                };
                let by_weight = key.f_reshape([-1])?.f_argsort_stable(true, 0, true)?;
                let order = by_weight
                    .f_index_select(0, &slots.f_index_select(0, &by_weight)?.f_argsort_stable(true, 0, false)?)?;
                let starts = counts.f_cumsum(0, Kind::Int64)?.f_sub(&counts)?;
                let place = Tensor::f_arange(order.size()[0], (Kind::Int64, order.device()))?
                    .f_sub(&starts.f_index_select(0, &slots.f_index_select(0, &order)?)?)?;
                let kept = order.f_masked_select(&place.f_lt(capacity)?)?;
                let dropped = order.size()[0] - kept.size()[0];
                (kept, counts.f_clamp_max(capacity)?, dropped)
            }
        };
        let token_of = order.f_floor_divide_scalar(k)?;
        let grouped = x.f_index_select(0, &token_of)?;
        let grouped = match self.scale_inputs {
            true => grouped.f_mul(
                &routing.weights.f_reshape([-1])?.f_index_select(0, &order)?.f_unsqueeze(1)?.f_to_kind(x.kind())?,
            )?,
            false => grouped,
        };
        let (computed, remote) = match p.experts() {
            Some(group) => self.exchanged(p, group, &grouped, &counts)?,
            None => (self.computed(p, &grouped, &host_counts(&counts)?, 0)?, 0),
        };
        // Back to slot order: row `i` is slot `order[i]`'s; a dropped slot's stays zero.
        let by_slot = Tensor::f_zeros([slots.size()[0], x.size()[1]], (Kind::Float, x.device()))?.f_index_copy(
            0,
            &order,
            &computed.f_to_kind(Kind::Float)?,
        )?;
        let weighted = match self.scale_inputs {
            true => by_slot,
            false => by_slot.f_mul(&routing.weights.f_reshape([-1, 1])?)?,
        };
        let summed = weighted.f_reshape([-1, k, x.size()[1]])?.f_sum_dim_intlist(1, false, Kind::Float)?;
        Ok((summed.f_to_kind(x.kind())?, Dispatch { remote, dropped }))
    }

    /// `rows`, grouped by expert (`counts[j]` rows for expert `first + j`, in order), through
    /// their experts. An expert without rows still runs, over none: its backward gives its
    /// weights a zero gradient rather than none, so whatever reduces their gradients (the
    /// tensor group under sequence parallel, data parallel) sees the same on every rank.
    fn computed(&self, p: &Params<'_>, rows: &Tensor, counts: &[i64], first: usize) -> Result<Tensor> {
        if let Some(out) = self.grouped(p, rows, counts, first)? {
            return Ok(out);
        }
        let mut outputs = Vec::with_capacity(counts.len());
        let mut start = 0;
        for (j, &count) in counts.iter().enumerate() {
            outputs.push(self.experts[first + j].forward(p, &rows.f_narrow(0, start, count)?)?);
            start += count;
        }
        Ok(Tensor::f_cat(&outputs, 0)?)
    }

    /// [`Self::computed`] in three grouped products (gate, up and down of every expert at
    /// once) where [`grouped_linear`] serves them, the experts are plain SwiGLU ones (no
    /// biases, no adapters) and each expert's share of the rows is small; `None` otherwise.
    /// An expert without rows gets a zero gradient from the stacked weights' backward.
    fn grouped(&self, p: &Params<'_>, rows: &Tensor, counts: &[i64], first: usize) -> Result<Option<Tensor>> {
        // On an H200 (`strata bench gpu --parts experts`) the grouped products took Qwen3-30B-A3B's
        // 128 experts at 1,024 rows each 3.2 times faster than a product per expert, and
        // Mixtral's 8 at 4,096 rows 0.86 times as fast: products of that many rows already
        // fill the GPU, and the grouped ones first stack the weights.
        const GROUPED_BELOW_ROWS_PER_EXPERT: i64 = 2048;
        if rows.size()[0] >= GROUPED_BELOW_ROWS_PER_EXPERT * counts.len() as i64 {
            return Ok(None);
        }
        let experts = &self.experts[first..first + counts.len()];
        let plain = experts.iter().all(|e| {
            e.biases.is_none()
                && matches!(e.activation, ExpertActivation::Silu)
                && [e.gate, Some(e.up), Some(e.down)].into_iter().flatten().all(|w| !p.has_adapter(w))
        });
        let gates: Option<Vec<&Tensor>> = experts.iter().map(|e| e.gate.map(|g| &p[g])).collect();
        let Some(gates) = gates.filter(|_| plain) else { return Ok(None) };
        let product = |x: &Tensor, pick: fn(&Expert) -> ParamId| {
            let weights: Vec<&Tensor> = experts.iter().map(|e| &p[pick(e)]).collect();
            grouped_linear(x, &weights, counts)
        };
        let (Some(gate), Some(up)) = (grouped_linear(rows, &gates, counts)?, product(rows, |e| e.up)?) else {
            return Ok(None);
        };
        product(&swiglu(&gate, &up)?, |e| e.down)
    }

    /// Expert parallelism: the rows grouped by expert (`counts` per expert, all `E`) go to
    /// the ranks computing their experts, which compute them for every rank of the group,
    /// and come back in the order they left. Every rank takes part in each all-to-all,
    /// forward and backward, whatever it sends or receives (empty pieces included), so a
    /// rank whose experts receive no tokens never leaves the others waiting.
    fn exchanged(
        &self,
        p: &Params<'_>,
        group: &Arc<dyn ExpertExchange>,
        rows: &Tensor,
        counts: &Tensor,
    ) -> Result<(Tensor, i64)> {
        let (size, rank) = (group.size(), group.rank());
        let experts = self.experts.len();
        if !experts.is_multiple_of(size) {
            return Err(Error::Config(format!("expert_parallel: {experts} experts do not split over {size} ranks")));
        }
        let local = experts / size;
        // Each rank learns how many rows of each of its experts every rank sends.
        let sent_counts = counts.f_reshape([size as i64, local as i64])?;
        let pieces: Vec<Tensor> = (0..size as i64).map(|d| sent_counts.get(d)).collect();
        let received_counts = group.all_to_all(&pieces, &vec![local as i64; size])?;
        let received_counts: Vec<Vec<i64>> = received_counts.iter().map(host_counts).collect::<Result<_>>()?;
        let send = host_counts(&sent_counts.f_sum_dim_intlist(1, false, Kind::Int64)?)?;
        let receive: Vec<i64> = received_counts.iter().map(|c| c.iter().sum()).collect();
        let received = Exchange::apply(group, rows, &send, &receive)?;
        // Received rows come rank by rank, each rank's grouped by expert: regroup them by
        // expert across ranks, compute, and put them back in the order they came.
        let mut by_expert = Vec::with_capacity(receive.iter().sum::<i64>() as usize);
        let mut starts: Vec<i64> = receive.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        for j in 0..local {
            for (s, counts) in received_counts.iter().enumerate() {
                by_expert.extend(starts[s]..starts[s] + counts[j]);
                starts[s] += counts[j];
            }
        }
        let per_expert: Vec<i64> = (0..local).map(|j| received_counts.iter().map(|c| c[j]).sum()).collect();
        let order = Tensor::f_from_slice(&by_expert)?.f_to_device(rows.device())?;
        let regrouped = received.f_index_select(0, &order)?;
        let computed = self.computed(p, &regrouped, &per_expert, rank * local)?;
        let arrived = computed.f_index_select(0, &order.f_argsort_stable(false, 0, false)?)?;
        let remote = send.iter().sum::<i64>() - send[rank];
        Ok((Exchange::apply(group, &arrived, &receive, &send)?, remote))
    }
}

/// 1 for each token of hidden states `[B, T, D]` (of `size`) and 0 for padding, `[B·T]`
/// fp32, where the rows are padded; under sequence parallel this rank's part of the
/// sequence.
fn real_tokens(p: &Params<'_>, size: &[i64]) -> Result<Option<Tensor>> {
    let Some(padding) = p.padding() else { return Ok(None) };
    let tp = p.tp();
    let mine = match tp.sequence_parallel() && tp.size() > 1 {
        true => padding.f_chunk(tp.size(), 1)?.swap_remove(tp.rank() as usize),
        false => padding.shallow_clone(),
    };
    if mine.numel() as i64 != size[..size.len() - 1].iter().product::<i64>() {
        return Err(Error::Model(format!("padding of {:?} positions for hidden states {size:?}", mine.size())));
    }
    Ok(Some(mine.f_logical_not()?.f_to_kind(Kind::Float)?.f_reshape([-1])?))
}

/// A tensor of counts, on the host.
fn host_counts(counts: &Tensor) -> Result<Vec<i64>> {
    let counts = counts.f_to_device(tch::Device::Cpu)?.f_to_kind(Kind::Int64)?;
    Vec::<i64>::try_from(&counts).map_err(|e| Error::Model(format!("expert counts: {e}")))
}

/// The all-to-all of an expert group as one autograd node: rows `send[r]` at a time go to
/// rank `r`, `receive[r]` come from it; backward sends the gradients back the same way.
struct Exchange {
    group: Arc<dyn ExpertExchange>,
    send: Vec<i64>,
    receive: Vec<i64>,
    /// The rows' shape past their count, and their dtype and device.
    width: Vec<i64>,
    options: (Kind, tch::Device),
}

impl Exchange {
    fn apply(group: &Arc<dyn ExpertExchange>, rows: &Tensor, send: &[i64], receive: &[i64]) -> Result<Tensor> {
        let node = Exchange {
            group: Arc::clone(group),
            send: send.to_vec(),
            receive: receive.to_vec(),
            width: rows.size()[1..].to_vec(),
            options: (rows.kind(), rows.device()),
        };
        Ok(strata_ext::apply_function(node, &[rows])?.remove(0))
    }

    /// `x` cut into pieces of `send` rows, exchanged, the `receive`-row pieces joined.
    fn run(&self, x: &Tensor, send: &[i64], receive: &[i64]) -> std::result::Result<Tensor, String> {
        let go = || -> Result<Tensor> {
            let pieces = x.f_split_with_sizes(send, 0)?;
            let received = self.group.all_to_all(&pieces, receive)?;
            Ok(Tensor::f_cat(&received, 0)?)
        };
        go().map_err(|e| e.to_string())
    }
}

impl strata_ext::Function for Exchange {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![self.run(&inputs[0], &self.send, &self.receive)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        // A gradient that did not reach the output is zeros: the exchange still runs.
        let grad = match grads[0].defined() {
            true => grads[0].shallow_clone(),
            false => {
                let rows: i64 = self.receive.iter().sum();
                Tensor::f_zeros([&[rows][..], &self.width].concat(), self.options).map_err(|e| e.to_string())?
            }
        };
        Ok(vec![self.run(&grad, &self.receive, &self.send)?])
    }
}

/// What the sparse layers routed in each micro-batch's forward, gathered for the
/// load-balancing loss and the run's metrics. One per model instance, shared by its sparse
/// layers.
///
/// A pipeline stage holds some of the sparse layers: its routing sums ([`LoadBalance::sums`])
/// travel forward with the activations, the stage holding the last layers closes the loss,
/// and the gradient of each layer's summed probabilities travels back with the activations'
/// gradients ([`LoadBalance::receive_gradient`]).
///
/// Where the choice biases move ([`MoeConfig::bias_update_rate`]), it also counts each
/// sparse layer's expert loads over a step's training forwards ([`LoadBalance::count_step`])
/// and turns the loads of every rank into the biases' steps ([`LoadBalance::bias_steps`]).
pub struct LoadBalance {
    experts: i64,
    layers: usize,
    coef: f64,
    z_coef: f64,
    bias_rate: f64,
    state: Mutex<BalanceState>,
}

#[derive(Default)]
struct BalanceState {
    /// The micro-batch the layers now record into and whose gradient their backward reads
    /// (a recomputed forward records its micro-batch's routing again).
    current: usize,
    micros: HashMap<usize, MicroRouting>,
    /// Each sparse layer's choice bias, by the layer's place among the sparse layers.
    choice_biases: BTreeMap<usize, ParamId>,
    /// Token slots per expert `[E]` each sparse layer received in this step's training
    /// forwards so far (counted only where the choice biases move).
    step_slots: BTreeMap<usize, Tensor>,
}

#[derive(Default)]
struct MicroRouting {
    /// Per sparse layer of this model part: token slots per expert `[E]` and summed
    /// probabilities `[E]` (fp32, detached), and the tokens routed.
    routed: Vec<Option<LayerRouting>>,
    /// The sums of the sparse layers of earlier pipeline stages ([`LoadBalance::sums`]).
    earlier: Option<Vec<f64>>,
    /// After a forward that records for backward: the gradient of the loss with respect to
    /// each layer's summed probabilities `[E]` and its summed squared log-partitions (the
    /// z-loss's), `[E + 1]` in all, per unit of the anchor's gradient.
    coefficient: Option<Tensor>,
    /// A scalar leaf of value 0 added to the training loss: its gradient is the factor
    /// (micro-batch weight, loss scale) the loss was multiplied by before backward.
    anchor: Option<Tensor>,
    /// The gradient handed back by a later pipeline stage, which closed the loss.
    gradient: Option<Tensor>,
}

struct LayerRouting {
    slots: Tensor,
    prob_sums: Tensor,
    /// The slots the load-balancing loss counts (its experts' without a choice bias).
    counted_slots: Tensor,
    /// `Σ logsumexp(logits)²` over the tokens (detached), where the z-loss is trained.
    z_sum: Option<Tensor>,
    tokens: i64,
    dispatch: Dispatch,
}

/// What a forward's sparse layers routed: the report, and where the forward records for
/// backward, the term to add to the training loss (its value `coef · aux_loss`; backward
/// through it hands the layers the factor the loss is weighted by).
pub struct Routed {
    /// The load-balancing loss and token counts of the forward.
    pub report: BalanceReport,
    /// The term to add to the training loss (the weighted load-balancing and z-losses), where
    /// the forward records for backward and either loss is trained.
    pub loss_term: Option<Tensor>,
}

/// The load-balancing loss of a forward and the token counts behind it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BalanceReport {
    /// `E · Σ_e f_e · P_e` over every sparse layer (before `router_aux_loss_coef`).
    pub aux_loss: f64,
    /// Token slots the least and the most loaded expert received, over all sparse layers.
    pub min_expert_tokens: i64,
    /// Token slots the most loaded expert received, over all sparse layers.
    pub max_expert_tokens: i64,
    /// Token slots this rank sent to experts computed on other ranks of its expert group
    /// (expert parallelism; 0 without), over all sparse layers.
    pub remote_expert_tokens: i64,
    /// Token slots dropped past an expert's capacity, over all sparse layers.
    pub dropped_expert_tokens: i64,
    /// The router z-loss (before its weight): the mean over tokens of
    /// `logsumexp(logits)²`, summed over sparse layers; 0 where it is not trained.
    pub z_loss: f64,
}

impl LoadBalance {
    /// The balance of `moe`'s `layers` sparse layers.
    pub(crate) fn new(moe: &MoeConfig, layers: usize) -> LoadBalance {
        LoadBalance {
            experts: moe.experts,
            layers,
            coef: moe.aux_loss_coef,
            z_coef: moe.z_loss_coef,
            bias_rate: moe.bias_update_rate,
            state: Mutex::new(BalanceState::default()),
        }
    }

    /// Records that sparse layer `layer` chooses its experts with the choice bias `id`.
    fn hold_choice_bias(&self, layer: usize, id: ParamId) {
        self.state().choice_biases.insert(layer, id);
    }

    /// The choice biases that move after each step, where they do: (sparse layer, bias).
    pub fn moving_biases(&self) -> Vec<(usize, ParamId)> {
        match self.bias_rate > 0.0 {
            true => self.state().choice_biases.iter().map(|(&l, &id)| (l, id)).collect(),
            false => vec![],
        }
    }

    /// Adds micro-batch `micro`'s routing in the layers whose bias `holds` (this model
    /// part's) to the step's loads: called once after each training forward, so that a
    /// recomputed forward and evaluation count nothing.
    pub fn count_step(&self, micro: usize, holds: impl Fn(ParamId) -> bool) -> Result<()> {
        if self.bias_rate == 0.0 {
            return Ok(());
        }
        let mut guard = self.state();
        let state = &mut *guard;
        let Some(m) = state.micros.get(&micro) else { return Ok(()) };
        for (&layer, _) in state.choice_biases.iter().filter(|(_, &id)| holds(id)) {
            let Some(routed) = m.routed.get(layer).and_then(Option::as_ref) else { continue };
            let sum = match state.step_slots.get(&layer) {
                Some(sum) => sum.f_add(&routed.slots)?,
                None => routed.slots.copy(),
            };
            state.step_slots.insert(layer, sum);
        }
        Ok(())
    }

    /// The step's loads `[sparse layers × E]` of the layers whose bias `holds` (zeros in the
    /// others' rows, so that ranks holding different layers add up), forgotten here: what the
    /// ranks sum before [`LoadBalance::bias_steps`].
    pub fn take_step_loads(&self, holds: impl Fn(ParamId) -> bool) -> Result<Vec<f64>> {
        let e = self.experts as usize;
        let mut loads = vec![0.0; self.layers * e];
        let mut guard = self.state();
        let state = &mut *guard;
        let counted: Vec<(usize, Tensor)> = state
            .choice_biases
            .iter()
            .filter(|(_, &id)| holds(id))
            .filter_map(|(layer, _)| state.step_slots.remove(layer).map(|slots| (*layer, slots)))
            .collect();
        if counted.is_empty() {
            return Ok(loads);
        }
        // Every layer's counts brought to the host in one copy.
        let all: Vec<&Tensor> = counted.iter().map(|(_, slots)| slots).collect();
        let host = Tensor::f_cat(&all, 0)?.f_to_device(tch::Device::Cpu)?.f_to_kind(Kind::Double)?;
        let values = Vec::<f64>::try_from(&host).map_err(|err| Error::Model(format!("expert loads: {err}")))?;
        for ((layer, _), row) in counted.iter().zip(values.chunks(e)) {
            loads[layer * e..(layer + 1) * e].copy_from_slice(row);
        }
        Ok(loads)
    }

    /// Each moving bias `holds` and its step from the loads of every rank (as
    /// [`LoadBalance::take_step_loads`] lays them out): `rate · sign(mean − load)` per
    /// expert, so underloaded experts are chosen more and overloaded ones less.
    pub fn bias_steps(&self, loads: &[f64], holds: impl Fn(ParamId) -> bool) -> Vec<(ParamId, Vec<f64>)> {
        let e = self.experts as usize;
        self.moving_biases()
            .into_iter()
            .filter(|&(_, id)| holds(id))
            .filter_map(|(layer, id)| {
                let row = loads.get(layer * e..(layer + 1) * e)?;
                Some((id, sign_steps(row, self.bias_rate)))
            })
            .collect()
    }

    fn state(&self) -> MutexGuard<'_, BalanceState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether the training loss gains a term from the routing (the load-balancing loss,
    /// the router z-loss), whose gradient reaches every sparse layer's router.
    pub fn adds_loss(&self) -> bool {
        self.coef > 0.0 || self.z_coef > 0.0
    }

    /// Forgets micro-batch `micro`'s earlier routing and records its forward's: called
    /// before a forward.
    pub fn open(&self, micro: usize) {
        let mut state = self.state();
        state.current = micro;
        let routed = (0..self.layers).map(|_| None).collect();
        state.micros.insert(micro, MicroRouting { routed, ..Default::default() });
    }

    /// Makes `micro` the micro-batch whose gradient the layers' backward reads (and whose
    /// routing a recomputed forward records): called before its backward.
    pub fn select(&self, micro: usize) {
        self.state().current = micro;
    }

    /// Records sparse layer `layer`'s routing and passes its output `y` through the node
    /// that adds the loss's gradient to `probs` in backward.
    fn attach(self: &Arc<Self>, layer: usize, y: &Tensor, routing: &Routing, dispatch: Dispatch) -> Result<Tensor> {
        let (prob_sums, slot_weights, tokens) = match &routing.real {
            Some(real) => {
                let prob_sums = routing.probs.f_mul(&real.f_unsqueeze(1)?)?.f_sum_dim_intlist(0, false, Kind::Float)?;
                let k = routing.experts.size()[1];
                let slot_weights = real.f_repeat_interleave_self_int(k, Some(0), None)?;
                (prob_sums, Some(slot_weights), real.f_sum(Kind::Float)?.f_double_value(&[])?.round() as i64)
            }
            None => (routing.probs.f_sum_dim_intlist(0, false, Kind::Float)?, None, routing.probs.size()[0]),
        };
        let count = |experts: &Tensor| {
            tch::no_grad(|| {
                experts.f_reshape([-1])?.f_bincount(slot_weights.as_ref(), self.experts)?.f_to_kind(Kind::Float)
            })
        };
        let slots = count(&routing.experts)?;
        let counted_slots = match &routing.counted {
            Some(counted) => count(counted)?,
            None => slots.shallow_clone(),
        };
        let routed = LayerRouting {
            slots,
            prob_sums: prob_sums.detach(),
            counted_slots,
            z_sum: routing.z_sum.as_ref().map(Tensor::detach),
            tokens,
            dispatch,
        };
        let micro = {
            let mut state = self.state();
            let micro = state.current;
            let entry = state.micros.entry(micro).or_default();
            entry.routed.resize_with(self.layers, || None);
            entry.routed[layer] = Some(routed);
            micro
        };
        if !self.adds_loss() || !prob_sums.requires_grad() {
            return Ok(y.shallow_clone());
        }
        let node = BalanceGradient { balance: Arc::clone(self), micro };
        let inputs: Vec<&Tensor> = [y, &prob_sums].into_iter().chain(routing.z_sum.as_ref()).collect();
        Ok(strata_ext::apply_function(node, &inputs)?.remove(0))
    }

    /// Micro-batch `micro`'s routing so far, this part's sparse layers' and the earlier
    /// stages' together: token slots per expert `[E]`, summed probabilities `[E]`, the slots
    /// the loss counts `[E]`, then the tokens routed, the slots sent to other ranks, the
    /// slots dropped, the summed squared log-partitions and the layers that routed
    /// (`SUMS_PAST_EXPERTS` values). What a pipeline stage sends on with its activations.
    pub fn sums(&self, micro: usize) -> Result<Vec<f64>> {
        let state = self.state();
        let e = self.experts as usize;
        let mut sums = vec![0.0; 3 * e + SUMS_PAST_EXPERTS];
        let Some(m) = state.micros.get(&micro) else { return Ok(sums) };
        let layers: Vec<&LayerRouting> = m.routed.iter().flatten().collect();
        if !layers.is_empty() {
            // Summed where the layers computed, then brought to the host in one copy.
            let stack = |pick: fn(&LayerRouting) -> &Tensor| -> Result<Tensor> {
                let all: Vec<&Tensor> = layers.iter().map(|r| pick(r)).collect();
                Ok(Tensor::f_stack(&all, 0)?.f_sum_dim_intlist(0, false, Kind::Float)?)
            };
            let all = [stack(|r| &r.slots)?, stack(|r| &r.prob_sums)?, stack(|r| &r.counted_slots)?];
            let all = Tensor::f_cat(&all, 0)?.f_to_device(tch::Device::Cpu)?.f_to_kind(Kind::Double)?;
            let values = Vec::<f64>::try_from(&all).map_err(|e| Error::Model(format!("expert loads: {e}")))?;
            sums[..3 * e].copy_from_slice(&values);
        }
        let z_sums: Vec<&Tensor> = layers.iter().filter_map(|r| r.z_sum.as_ref()).collect();
        if !z_sums.is_empty() {
            sums[3 * e + 3] = Tensor::f_stack(&z_sums, 0)?.f_sum(Kind::Double)?.f_double_value(&[])?;
        }
        sums[3 * e] = layers.iter().map(|r| r.tokens as f64).sum();
        sums[3 * e + 1] = layers.iter().map(|r| r.dispatch.remote as f64).sum();
        sums[3 * e + 2] = layers.iter().map(|r| r.dispatch.dropped as f64).sum();
        sums[3 * e + 4] = layers.len() as f64;
        if let Some(earlier) = &m.earlier {
            sums.iter_mut().zip(earlier).for_each(|(s, e)| *s += e);
        }
        Ok(sums)
    }

    /// The sparse layers that routed micro-batch `micro`: this part's and the earlier
    /// stages'.
    fn layers_routed(&self, micro: usize) -> usize {
        let state = self.state();
        let Some(m) = state.micros.get(&micro) else { return 0 };
        let earlier = m.earlier.as_ref().map_or(0.0, |s| s[s.len() - 1]) as usize;
        m.routed.iter().flatten().count() + earlier
    }

    /// The earlier pipeline stages' [`LoadBalance::sums`] of micro-batch `micro`, received
    /// with its activations (after this part's forward opened it).
    pub fn receive_sums(&self, micro: usize, earlier: Vec<f64>) -> Result<()> {
        if earlier.len() != 3 * self.experts as usize + SUMS_PAST_EXPERTS {
            return Err(Error::Model(format!("routing sums of {} values for {} experts", earlier.len(), self.experts)));
        }
        self.state().micros.entry(micro).or_default().earlier = Some(earlier);
        Ok(())
    }

    /// After a forward of micro-batch `micro` that every sparse layer took part in (here
    /// or, in a pipeline, here and in the earlier stages): the load-balancing loss and the
    /// experts' loads; with `for_backward`, also the coefficient each layer's backward adds
    /// and the training loss's term. `None` while some layer has not routed. `sharers`: the
    /// ranks that routed other parts of the same rows.
    pub fn close(&self, micro: usize, for_backward: bool, sharers: RowSharers<'_>) -> Result<Option<Routed>> {
        // Counted before anything is read from the device: a pipeline stage's part alone
        // never closes the loss.
        if self.layers_routed(micro) != self.layers {
            return Ok(None);
        }
        let mut sums = self.sums(micro)?;
        let e = self.experts as usize;
        let layers = sums[3 * e + 4];
        let summed = sharers.sum_values(&sums[..3 * e + 4])?;
        sums[..3 * e + 4].copy_from_slice(&summed);
        // Context ranks average their gradients as data ranks do, each having weighed its
        // loss by its piece's tokens: the loss of whole rows reaches each piece's routing
        // as often as there are pieces (exactly where the pieces hold as many supervised
        // tokens each).
        let pieces = sharers.context.map_or(1.0, |c| c.size() as f64);
        let rows = sums[3 * e].max(1.0);
        let shares: Vec<f64> = sums[2 * e..3 * e].iter().map(|slots| slots / rows).collect();
        let aux = shares.iter().zip(&sums[e..2 * e]).map(|(f, p)| f * p / rows).sum::<f64>() * self.experts as f64;
        // Every layer routes the same tokens: `rows / layers` of them.
        let tokens = rows / layers.max(1.0);
        let z = sums[3 * e + 3] / tokens;
        let slots = &sums[..e];
        let report = BalanceReport {
            aux_loss: aux,
            min_expert_tokens: slots.iter().copied().fold(f64::INFINITY, f64::min) as i64,
            max_expert_tokens: slots.iter().copied().fold(0.0, f64::max) as i64,
            remote_expert_tokens: sums[3 * e + 1] as i64,
            dropped_expert_tokens: sums[3 * e + 2] as i64,
            z_loss: z,
        };
        let mut state = self.state();
        let m = state.micros.entry(micro).or_default();
        let loss_term = if for_backward && self.adds_loss() {
            // d(coef · E · Σ f_e P_e) / d(layer's summed probability of e) = coef · E · f_e / rows,
            // and d(z_coef · Σ_layers z_sum / tokens) / d(layer's z_sum) = z_coef / tokens.
            let scale = self.coef * self.experts as f64 / rows * pieces;
            let mut coefficient: Vec<f32> = shares.iter().map(|f| (f * scale) as f32).collect();
            coefficient.push((self.z_coef / tokens * pieces) as f32);
            m.coefficient = Some(Tensor::f_from_slice(&coefficient)?);
            let anchor = Tensor::f_zeros([], (Kind::Float, tch::Device::Cpu))?.set_requires_grad(true);
            m.anchor = Some(anchor.shallow_clone());
            Some(anchor.f_add_scalar(self.coef * aux + self.z_coef * z)?)
        } else {
            None
        };
        Ok(Some(Routed { report, loss_term }))
    }

    /// The gradient each sparse layer's summed probabilities receive in micro-batch
    /// `micro`'s backward: the one a later pipeline stage handed back, or else the
    /// coefficient times the factor the training loss was weighted by (the anchor's
    /// gradient, known once the loss's backward began). What a pipeline stage sends back.
    pub fn gradient(&self, micro: usize) -> Result<Tensor> {
        let state = self.state();
        let m = state.micros.get(&micro);
        if let Some(g) = m.and_then(|m| m.gradient.as_ref()) {
            return Ok(g.shallow_clone());
        }
        let (Some(coefficient), Some(anchor)) =
            (m.and_then(|m| m.coefficient.as_ref()), m.and_then(|m| m.anchor.as_ref()))
        else {
            return Err(Error::Model(
                "a sparse layer's backward ran without the load-balancing loss: add the term \
                 Engine::routed gives to the training loss"
                    .into(),
            ));
        };
        let factor = anchor.grad();
        if !factor.defined() {
            return Err(Error::Model("the training loss does not include the load-balancing loss's term".into()));
        }
        Ok(coefficient.f_mul(&factor)?)
    }

    /// The gradient of micro-batch `micro`'s summed probabilities, from the later pipeline
    /// stage that closed the loss: called before this part's backward of it.
    pub fn receive_gradient(&self, micro: usize, gradient: Tensor) {
        self.state().micros.entry(micro).or_default().gradient = Some(gradient);
    }
}

/// DeepSeek-V3's update of one layer's choice bias from its experts' `loads`:
/// `rate · sign(mean − load)` per expert (0 for an expert loaded exactly at the mean).
fn sign_steps(loads: &[f64], rate: f64) -> Vec<f64> {
    let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    loads
        .iter()
        .map(|&load| match mean.partial_cmp(&load) {
            Some(std::cmp::Ordering::Greater) => rate,
            Some(std::cmp::Ordering::Less) => -rate,
            _ => 0.0,
        })
        .collect()
}

/// The values [`LoadBalance::sums`] holds past the three per expert.
const SUMS_PAST_EXPERTS: usize = 5;

/// The identity on a sparse layer's output whose backward also hands the layer's summed
/// routing probabilities their share of the load-balancing loss's gradient.
struct BalanceGradient {
    balance: Arc<LoadBalance>,
    micro: usize,
}

impl strata_ext::Function for BalanceGradient {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![inputs[0].shallow_clone()])
    }

    /// Inputs: the output, the summed probabilities `[E]` and, where the z-loss is
    /// trained, the summed squared log-partitions (a scalar).
    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let go = || -> Result<Vec<Tensor>> {
            let g = self.balance.gradient(self.micro)?.f_to_device(grads[0].device())?;
            let e = self.balance.experts;
            let mut out = vec![grads[0].shallow_clone(), g.f_narrow(0, 0, e)?];
            if self.balance.z_coef > 0.0 {
                out.push(g.f_select(0, e)?);
            }
            Ok(out)
        };
        go().map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIM: i64 = 6;
    const WIDTH: i64 = 5;
    const EXPERTS: usize = 4;

    /// A sparse layer of 4 experts, top 2 renormalised, over random weights (router first,
    /// then each expert's gate, up and down).
    fn layer(capacity_factor: Option<f64>) -> (SparseFeedForward, Vec<Tensor>) {
        tch::manual_seed(7);
        let mut tensors = vec![Tensor::randn([EXPERTS as i64, DIM], (Kind::Float, tch::Device::Cpu))];
        let experts = (0..EXPERTS)
            .map(|e| {
                for shape in [[WIDTH, DIM], [WIDTH, DIM], [DIM, WIDTH]] {
                    tensors.push(Tensor::randn(shape, (Kind::Float, tch::Device::Cpu)) * 0.3);
                }
                let id = |j: usize| ParamId(1 + 3 * e + j);
                Expert { gate: Some(id(0)), up: id(1), down: id(2), biases: None, activation: ExpertActivation::Silu }
            })
            .collect();
        let balance = Arc::new(LoadBalance::new(&MoeConfig::new(EXPERTS as i64, 2, WIDTH), 1));
        let ff = SparseFeedForward {
            router: Router {
                weight: ParamId(0),
                bias: None,
                choice_bias: None,
                input_norm: None,
                expert_scales: None,
                scoring: Scoring::Softmax,
                top_k: 2,
                norm_topk: true,
                groups: 1,
                top_groups: 1,
                group_score: GroupScore::TopTwoSum,
                scale: 1.0,
                norm_epsilon: renormalisation_epsilon(),
                balance_over_softmax: false,
            },
            experts,
            shared: None,
            latent: None,
            capacity_factor,
            scale_inputs: false,
            layer: 0,
            balance,
        };
        (ff, tensors)
    }

    /// Token by token: each expert keeps at most `capacity` of its slots, those of highest
    /// weight (the earlier slot first among equals), and a token sums its kept slots' outputs.
    fn by_hand(ff: &SparseFeedForward, tensors: &[Tensor], x: &Tensor, capacity: usize) -> (Tensor, usize) {
        let p = Params::new(tensors);
        let probs = x.matmul(&tensors[0].tr()).softmax(-1, Kind::Float);
        let (weights, chosen) = probs.topk(2, -1, true, true);
        let weights = &weights / weights.sum_dim_intlist(-1, true, Kind::Float);
        let tokens = x.size()[0];
        let mut slots: Vec<Vec<(f64, i64, i64)>> = vec![vec![]; EXPERTS];
        for t in 0..tokens {
            for j in 0..2 {
                let e = chosen.int64_value(&[t, j]) as usize;
                slots[e].push((weights.double_value(&[t, j]), t, j));
            }
        }
        let mut y = Tensor::zeros([tokens, DIM], (Kind::Float, tch::Device::Cpu));
        let mut dropped = 0;
        for (e, mut mine) in slots.into_iter().enumerate() {
            mine.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
            dropped += mine.len().saturating_sub(capacity);
            for &(w, t, _) in mine.iter().take(capacity) {
                let out = ff.experts[e].forward(&p, &x.get(t).unsqueeze(0)).unwrap().squeeze_dim(0);
                y = y.index_add(0, &Tensor::from_slice(&[t]), &(out * w).unsqueeze(0));
            }
        }
        (y, dropped)
    }

    #[test]
    fn a_choice_bias_steps_towards_its_underloaded_experts() {
        assert_eq!(sign_steps(&[9.0, 1.0, 3.0, 3.0], 0.5), [-0.5, 0.5, 0.5, 0.5]);
        assert_eq!(sign_steps(&[3.0, 3.0, 6.0, 0.0], 0.1), [0.0, 0.0, -0.1, 0.1], "mean 3");
        assert_eq!(sign_steps(&[5.0; 4], 0.1), [0.0; 4], "balanced");
    }

    /// `transformers`' `attention_mask` in the load-balancing loss: padded rows route as
    /// their real tokens alone do.
    #[test]
    fn padding_is_left_out_of_the_routing_statistics() {
        let x = Tensor::randn([2, 6, DIM], (Kind::Float, tch::Device::Cpu));
        let padding = Tensor::from_slice(&[0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]).view([2, 6]).to_kind(Kind::Bool);
        let real = Tensor::cat(&[x.get(0).narrow(0, 0, 4), x.get(1).narrow(0, 0, 3)], 0).unsqueeze(0);
        let (ff, tensors) = layer(None);
        let report = |x: &Tensor, padding: Option<&Tensor>| {
            ff.balance.open(0);
            let _ = ff.forward(&Params::new(&tensors).with_padding(padding), x, None).unwrap();
            ff.balance.close(0, false, RowSharers::default()).unwrap().unwrap().report
        };
        let (padded, alone, unmasked) = (report(&x, Some(&padding)), report(&real, None), report(&x, None));
        assert!((padded.aux_loss - alone.aux_loss).abs() < 1e-6, "{padded:?} against {alone:?}");
        assert_eq!(
            (padded.min_expert_tokens, padded.max_expert_tokens),
            (alone.min_expert_tokens, alone.max_expert_tokens)
        );
        assert!((unmasked.aux_loss - alone.aux_loss).abs() > 1e-4, "the padding changes nothing here: {unmasked:?}");
    }

    /// Padding's slots are the last an expert keeps: real tokens keep what they would keep
    /// among themselves alone, however the padding routes.
    #[test]
    fn past_its_capacity_padding_is_dropped_before_real_tokens() {
        let pads = [0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0];
        // Each padding position a real token's state, sharpened: it routes where that token
        // does with a heavier weight, so it would take that expert's room first.
        let real: Vec<i64> = (0..12).filter(|&i| pads[i as usize] == 0).collect();
        let x = Tensor::randn([12, DIM], (Kind::Float, tch::Device::Cpu));
        for (n, i) in (0..12).filter(|&i| pads[i as usize] == 1).enumerate() {
            x.get(i).copy_(&(x.get(real[n]) * 4.0));
        }
        let padding = Tensor::from_slice(&pads).view([1, 12]).to_kind(Kind::Bool);
        let real = Tensor::from_slice(&real);
        // 24 slots over 4 experts at a factor of 0.5: 3 each, of the 12 real slots' 3 a
        // balanced expert would take.
        let (ff, tensors) = layer(Some(0.5));
        ff.balance.open(0);
        let p = Params::new(&tensors).with_padding(Some(&padding));
        let y = ff.forward(&p, &x.unsqueeze(0), None).unwrap().squeeze_dim(0).index_select(0, &real);
        let _ = ff.balance.close(0, false, RowSharers::default()).unwrap();
        let (expected, _) = by_hand(&ff, &tensors, &x.index_select(0, &real), 3);
        let gap = (&y - &expected).abs().max().double_value(&[]);
        assert!(gap < 1e-5, "real tokens' outputs off by {gap}");
    }

    #[test]
    fn past_its_capacity_an_expert_keeps_its_heaviest_slots_and_drops_the_rest() {
        let x = Tensor::randn([12, DIM], (Kind::Float, tch::Device::Cpu));
        // 24 slots over 4 experts: 6 each when balanced; a factor of 0.5 keeps 3.
        for (factor, capacity) in [(None, usize::MAX), (Some(0.5), 3), (Some(4.0), 24)] {
            let (ff, tensors) = layer(factor);
            ff.balance.open(0);
            let y = ff.forward(&Params::new(&tensors), &x.unsqueeze(0), None).unwrap().squeeze_dim(0);
            let report = ff.balance.close(0, false, RowSharers::default()).unwrap().unwrap().report;
            let (expected, dropped) = by_hand(&ff, &tensors, &x, capacity);
            let gap = (&y - &expected).abs().max().double_value(&[]);
            assert!(gap < 1e-5, "capacity factor {factor:?}: off by {gap}");
            assert_eq!(report.dropped_expert_tokens as usize, dropped, "capacity factor {factor:?}");
            assert_eq!(dropped > 0, factor == Some(0.5), "capacity factor {factor:?}: {dropped} dropped");
        }
    }
}
