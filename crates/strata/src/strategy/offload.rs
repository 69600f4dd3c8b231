//! The `offload` method's configuration: which model states may leave the device for host
//! memory, and how their places are chosen. Configuration only: the plan is
//! `engine::placement`'s, its execution `engine::offload`'s.
use crate::engine::placement::HomePolicy;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Where one kind of model state may go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadTarget {
    /// Stays on the device.
    None,
    /// Goes to host memory (with `policy: static`, the `ratio` share of it).
    Cpu,
    /// The planner decides from the budgets (`policy: auto`).
    Auto,
}

/// How places are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadPolicy {
    /// Fixed shares on the host, whatever the budget.
    Static,
    /// As much on the device as the device budget allows, the rest on the host.
    Auto,
}

/// `offload`: `{"params": "none|cpu|auto", "optimizer": "none|cpu|auto", "policy":
/// "static|auto", "ratio": 1.0, "prefetch": 2, "pin_memory": true, "slot_bytes": null,
/// "delayed_update": false}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    /// Where units' parameters may go (default `auto`).
    pub params: OffloadTarget,
    /// Where units' optimizer states may go (default `auto`).
    pub optimizer: OffloadTarget,
    /// How places are chosen (default `auto`).
    pub policy: OffloadPolicy,
    /// With `policy: static`, the share of the model states (the first units, in bytes)
    /// whose `cpu` targets go to the host.
    pub ratio: f64,
    /// How many moments (a unit's forward or backward) ahead parameter copies start.
    pub prefetch: usize,
    /// Host buffers in page-locked memory where the device is a GPU (faster copies).
    pub pin_memory: bool,
    /// Unit kinds or names whose states always live on the host, and which compute there
    /// unless another unit reads their parameters (PatrickStar's `use_cpu_embedding`: the
    /// embedding's; a tied embedding, which the head reads, is copied to the device).
    pub host_units: Vec<String>,
    /// Bytes of one slot of the device pool the moving copies take (a multiple of the page
    /// size); `null`: the size that wastes the fewest bytes for the model's buffers.
    pub slot_bytes: Option<u64>,
    /// The host's updates of a step run during the next step, which computes with the
    /// parameters from before them (ZeRO-Offload's delayed parameter update; parameters
    /// must stay on the device).
    pub delayed_update: bool,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        OffloadConfig {
            params: OffloadTarget::Auto,
            optimizer: OffloadTarget::Auto,
            policy: OffloadPolicy::Auto,
            ratio: 1.0,
            prefetch: 2,
            pin_memory: true,
            host_units: vec![],
            slot_bytes: None,
            delayed_update: false,
        }
    }
}

impl OffloadConfig {
    /// This configuration with every state of every unit on the host (its prefetch, pinning,
    /// slots and units computing on the host kept; updates not delayed, which parameters on
    /// the host cannot be).
    pub fn everything_on_host(&self) -> OffloadConfig {
        OffloadConfig {
            params: OffloadTarget::Cpu,
            optimizer: OffloadTarget::Cpu,
            policy: OffloadPolicy::Static,
            ratio: 1.0,
            delayed_update: false,
            ..self.clone()
        }
    }

    /// How the planner chooses homes, or why this configuration is not one.
    pub fn home_policy(&self) -> Result<HomePolicy> {
        use OffloadTarget::{Auto, Cpu, None};
        let bad = |why: &str| Err(Error::Config(format!("offload: {why}")));
        if !(self.ratio > 0.0 && self.ratio <= 1.0) {
            return bad(&format!("ratio must lie in (0, 1], got {}", self.ratio));
        }
        if !self.host_units.is_empty() && self.params == None {
            return bad("host_units put parameters on the host: params cannot be \"none\"");
        }
        match self.policy {
            OffloadPolicy::Static => {
                let share = |t: OffloadTarget| match t {
                    None => Ok(0.0),
                    Cpu => Ok(self.ratio),
                    Auto => Err(Error::Config(
                        "offload: policy static places states where told; use \"cpu\" or \"none\", or policy auto"
                            .into(),
                    )),
                };
                let (params, optimizer) = (share(self.params)?, share(self.optimizer)?);
                if params > optimizer {
                    return bad("parameters on the host are updated there: optimizer must be \"cpu\" too");
                }
                if optimizer == 0.0 {
                    return bad("nothing is offloaded: set params or optimizer to \"cpu\"");
                }
                Ok(HomePolicy::Static { params, optimizer })
            }
            OffloadPolicy::Auto => match (self.params, self.optimizer) {
                (Cpu, _) | (_, Cpu) => {
                    bad("\"cpu\" fixes a state on the host: use policy static, or \"auto\" to let the planner decide")
                }
                (_, None) => bad("policy auto moves optimizer state first: optimizer must be \"auto\""),
                (params, Auto) => Ok(HomePolicy::Auto { params_may_leave: params == Auto }),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_policies_resolve_or_say_what_is_wrong() {
        let cpu = |params, optimizer| OffloadConfig {
            params,
            optimizer,
            policy: OffloadPolicy::Static,
            ..Default::default()
        };
        assert_eq!(
            cpu(OffloadTarget::None, OffloadTarget::Cpu).home_policy().unwrap(),
            HomePolicy::Static { params: 0.0, optimizer: 1.0 }
        );
        assert_eq!(OffloadConfig::default().home_policy().unwrap(), HomePolicy::Auto { params_may_leave: true });
        for (config, expected) in [
            (cpu(OffloadTarget::Cpu, OffloadTarget::None), "optimizer must be \"cpu\" too"),
            (cpu(OffloadTarget::None, OffloadTarget::None), "nothing is offloaded"),
            (cpu(OffloadTarget::Auto, OffloadTarget::Cpu), "policy static places"),
            (OffloadConfig { ratio: 0.0, ..Default::default() }, "ratio must lie in (0, 1]"),
            (OffloadConfig { params: OffloadTarget::Cpu, ..Default::default() }, "use policy static"),
            (OffloadConfig { optimizer: OffloadTarget::None, ..Default::default() }, "optimizer must be \"auto\""),
        ] {
            let err = config.home_policy().unwrap_err().to_string();
            assert!(err.contains(expected), "{config:?}: {err}");
        }
    }
}
