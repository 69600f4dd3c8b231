//! The sharding methods' configuration (`zero1`, `zero2`, `fsdp`): FSDP's arguments and
//! ATorch's wrap policy, and what they resolve to for a model — the ZeRO stage, the
//! prefetch order, each unit's wrap. Configuration only: the schedule that executes it is
//! `parallel::zero`'s.
use super::{parse_dtype, select_units};
use crate::model::ModelSpec;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::Kind;

/// FSDP's sharding strategies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ShardingStrategy {
    /// Parameters, gradients and optimizer states sharded; parameters freed after forward.
    FullShard,
    /// Parameters, gradients and optimizer states sharded; parameters kept gathered from
    /// forward to backward.
    ShardGradOp,
    /// Nothing sharded (shard groups of one rank): plain data parallelism.
    NoShard,
    /// As `FullShard` inside groups of `hybrid_shard_size` ranks, replicated across the groups.
    HybridShard,
}

/// When backward starts gathering the next unit's parameters (FSDP's `backward_prefetch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackwardPrefetch {
    /// Before the current unit's backward computes (more overlap, one more unit held).
    #[serde(rename = "BACKWARD_PRE")]
    Pre,
    /// After it, once its parameters are freed (overlaps the gradient reduction).
    #[serde(rename = "BACKWARD_POST")]
    Post,
}

/// FSDP's `MixedPrecision`: dtypes by name (`"bf16"`, `"fp16"`, `"fp32"`); unset ones
/// leave that data in the model's dtype.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MixedPrecision {
    /// The dtype the flat parameter buffers hold.
    pub param_dtype: Option<String>,
    /// The dtype gradients are reduce-scattered in (default: `param_dtype`).
    pub reduce_dtype: Option<String>,
    /// Accepted by name so that it can be refused with a reason: Strata's models hold no
    /// buffers, so it would change nothing.
    pub buffer_dtype: Option<String>,
}

/// Configuration of `zero1`, `zero2` and `fsdp`, with FSDP's argument names and defaults
/// and ATorch's wrap arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShardConfig {
    /// fsdp only (default FULL_SHARD).
    pub sharding_strategy: Option<ShardingStrategy>,
    /// fsdp only: when backward starts gathering the next unit's parameters (default
    /// `BACKWARD_PRE`).
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// fsdp only: start gathering the next unit's parameters before a unit's forward.
    pub forward_prefetch: bool,
    /// fsdp only (default on): at most one gather runs ahead of the unit being computed;
    /// off, two.
    pub limit_all_gathers: bool,
    /// zero2 and fsdp (DeepSpeed's name): a unit's gradient reduce-scatter runs during the
    /// next unit's backward, which then holds a second whole gradient. Off, the reduction
    /// completes first and model states stay at the ZeRO formula plus the units in use.
    pub overlap_comm: bool,
    /// Broadcast rank 0's initial parameters to every rank.
    pub sync_module_states: bool,
    /// Dtypes of parameters and gradient reductions (`None`: the model's).
    pub mixed_precision: Option<MixedPrecision>,
    /// Unit kinds or names wrapped on their own; other units join the outermost wrap.
    pub atorch_wrap_cls: Vec<String>,
    /// Units with at least this many parameters are wrapped on their own.
    pub atorch_size_based_min_num_params: Option<u64>,
    /// Unit kinds or names left unsharded (replicated).
    pub atorch_ignored_cls: Vec<String>,
    /// Units holding trainable parameters join the outermost wrap.
    pub wrap_trainable_outmost: bool,
    /// Ranks per shard group with HYBRID_SHARD (default: the ranks of one node).
    pub hybrid_shard_size: Option<usize>,
    /// Parameter groups select parameters by name whatever this says.
    pub use_orig_params: bool,
    /// PatrickStar's `release_after_init`, set by its face rather than a strategy key:
    /// stage 3 keeps every unit's whole parameters until the model is built, then releases
    /// the parts other ranks own (otherwise each unit's as soon as it is made).
    #[serde(skip)]
    pub release_after_init: bool,
}

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            sharding_strategy: None,
            backward_prefetch: Some(BackwardPrefetch::Pre),
            forward_prefetch: false,
            limit_all_gathers: true,
            overlap_comm: false,
            sync_module_states: false,
            mixed_precision: None,
            atorch_wrap_cls: vec![],
            atorch_size_based_min_num_params: None,
            atorch_ignored_cls: vec![],
            wrap_trainable_outmost: false,
            hybrid_shard_size: None,
            use_orig_params: false,
            release_after_init: false,
        }
    }
}

/// The sharding method a strategy resolves to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardMethod {
    /// `zero1`: optimizer states sharded.
    Zero1,
    /// `zero2`: optimizer states and gradients sharded.
    Zero2,
    /// `fsdp`: as its `sharding_strategy` says (default FULL_SHARD).
    Fsdp,
}

impl ShardMethod {
    /// The method's name in a strategy.
    pub fn name(self) -> &'static str {
        match self {
            ShardMethod::Zero1 => "zero1",
            ShardMethod::Zero2 => "zero2",
            ShardMethod::Fsdp => "fsdp",
        }
    }
}

impl std::fmt::Display for ShardMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which model states are sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Optimizer states (ZeRO-1).
    Optimizer = 1,
    /// And gradients (ZeRO-2, FSDP's SHARD_GRAD_OP).
    Gradients = 2,
    /// And parameters (ZeRO-3, FSDP's FULL_SHARD).
    Parameters = 3,
}

/// How a unit takes part in sharding (the result of a wrap policy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wrap {
    /// Sharded, gathered and freed on its own.
    Own,
    /// Sharded with the outermost wrap: gathered for the whole step, reduced at its end.
    Root,
    /// Not sharded: replicated on every rank, gradients all-reduced.
    Ignored,
}

impl MixedPrecision {
    /// The parameter and reduction dtypes.
    pub fn kinds(&self) -> Result<(Option<Kind>, Option<Kind>)> {
        let parse = |v: &Option<String>| v.as_deref().map(parse_dtype).transpose();
        Ok((parse(&self.param_dtype)?, parse(&self.reduce_dtype)?))
    }
}

impl ShardConfig {
    pub(super) fn validate(&self, method: &str) -> Result<()> {
        let bad = |what: String| Err(Error::Config(format!("{method}: {what}")));
        if method != "fsdp" && self.sharding_strategy.is_some() {
            return bad("sharding_strategy belongs to fsdp (zero1 and zero2 fix their own)".into());
        }
        if !self.atorch_wrap_cls.is_empty() && self.atorch_size_based_min_num_params.is_some() {
            return bad("atorch_wrap_cls and atorch_size_based_min_num_params exclude each other".into());
        }
        if self.hybrid_shard_size == Some(0) {
            return bad("hybrid_shard_size must be positive".into());
        }
        if self.hybrid_shard_size.is_some() && self.sharding_strategy != Some(ShardingStrategy::HybridShard) {
            return bad("hybrid_shard_size needs sharding_strategy HYBRID_SHARD".into());
        }
        if let Some(mp) = &self.mixed_precision {
            if let Err(e) = mp.kinds() {
                return bad(e.to_string().trim_start_matches("invalid configuration: ").to_string());
            }
            if mp.buffer_dtype.is_some() {
                return bad(
                    "mixed_precision.buffer_dtype: Strata's models hold no buffers, so it would change nothing".into(),
                );
            }
        }
        if method == "zero1" && self.overlap_comm {
            return bad("overlap_comm belongs to zero2 and fsdp: zero1 reduce-scatters no gradients".into());
        }
        // Prefetching orders the gathers of parameters, which only fsdp makes.
        let defaults = ShardConfig::default();
        let knobs = [
            ("forward_prefetch", self.forward_prefetch != defaults.forward_prefetch),
            ("backward_prefetch", self.backward_prefetch != defaults.backward_prefetch),
            ("limit_all_gathers", self.limit_all_gathers != defaults.limit_all_gathers),
        ];
        if let Some((knob, _)) = knobs.iter().find(|(_, set)| *set).filter(|_| method != "fsdp") {
            return bad(format!(
                "{knob} belongs to fsdp: {method} never gathers parameters, so it would change nothing"
            ));
        }
        Ok(())
    }

    /// The ZeRO stage and whether parameters are freed after forward.
    pub fn stage(&self, method: ShardMethod) -> (Stage, bool) {
        match (method, self.sharding_strategy) {
            (ShardMethod::Zero1, _) | (_, Some(ShardingStrategy::NoShard)) => (Stage::Optimizer, false),
            (ShardMethod::Zero2, _) => (Stage::Gradients, false),
            (_, Some(ShardingStrategy::ShardGradOp)) => (Stage::Parameters, false),
            _ => (Stage::Parameters, true),
        }
    }

    /// Applies the wrap policy to `spec`'s units. A name in a list must match some unit's
    /// kind or name.
    pub fn wrap(&self, spec: &ModelSpec) -> Result<Vec<Wrap>> {
        let wrapped = select_units(spec, &self.atorch_wrap_cls, "atorch_wrap_cls")?;
        let ignored = select_units(spec, &self.atorch_ignored_cls, "atorch_ignored_cls")?;
        Ok((0..spec.units.len())
            .map(|k| {
                let numel: i64 = spec.units[k].params.iter().map(|id| spec.params[id.0].numel()).sum();
                let trainable = spec.units[k].params.iter().any(|id| spec.params[id.0].requires_grad);
                let own = if !self.atorch_wrap_cls.is_empty() {
                    wrapped[k]
                } else {
                    self.atorch_size_based_min_num_params.is_none_or(|min| numel as u64 >= min)
                };
                if ignored[k] {
                    Wrap::Ignored
                } else if (self.wrap_trainable_outmost && trainable) || !own {
                    Wrap::Root
                } else {
                    Wrap::Own
                }
            })
            .collect())
    }
}
