//! Where each unit's model states live — on the compute device or in host memory — and,
//! for units whose parameters live on the host, when their copies come to the device and
//! when they leave: the plan that [`super::offload::Offload`] executes.
//!
//! The plan is computed before the first step, from bytes alone: the engine's schedule is
//! known (unit k's forward, the backward in reverse, then the optimizer's update), so the
//! device's contents at every moment are known too. Parameter copies on the device are
//! evicted by furthest next use; copies are never written back (parameters do not change
//! between updates), so traffic is what comes to the device plus the gradients that go to
//! the host. Owns no tensors and runs nothing: a pure function of sizes, budgets and order.
use crate::{Error, Result};
use serde::Serialize;
use std::collections::BTreeSet;

/// Where one unit's model states live between uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Home {
    /// Parameters, gradient and optimizer state on the device, updated there.
    Device,
    /// Parameters on the device; the master copy, the gradient and the optimizer state on
    /// the host, updated there and the parameters copied back (ZeRO-Offload).
    OptimizerOnHost,
    /// Everything on the host, updated there; the parameters are copied to the device for
    /// the unit's forward and backward, the gradient to the host after its backward.
    Host,
}

/// Bytes of one unit's model states: parameters as the unit computes with them, their
/// gradient (zero for a frozen unit) and the optimizer's state (masters and moments).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UnitStates {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    /// Bytes the update of this unit borrows for its duration where it runs (fp32 copies
    /// of low-precision parameters and gradients).
    pub update_scratch: u64,
}

impl UnitStates {
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    /// Bytes held on the device between uses under `home`.
    pub fn device_resident(&self, home: Home) -> u64 {
        match home {
            Home::Device => self.total(),
            Home::OptimizerOnHost => self.params,
            Home::Host => 0,
        }
    }

    /// Bytes held on the host under `home` (the host copy of the parameters is the master).
    pub fn host_resident(&self, home: Home) -> u64 {
        match home {
            Home::Device => 0,
            Home::OptimizerOnHost | Home::Host => self.total(),
        }
    }
}

/// A moment of a step, in the order the engine runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Moment {
    Forward(usize),
    Backward(usize),
    Update,
}

/// The moments of a step of `units` units: every forward, every backward in reverse, the
/// update.
pub fn step_moments(units: usize) -> Vec<Moment> {
    let forward = (0..units).map(Moment::Forward);
    let backward = (0..units).rev().map(Moment::Backward);
    forward.chain(backward).chain([Moment::Update]).collect()
}

/// The index of `moment` in [`step_moments`]`(units)`.
pub fn moment_index(units: usize, moment: Moment) -> usize {
    match moment {
        Moment::Forward(k) => k,
        Moment::Backward(k) => 2 * units - 1 - k,
        Moment::Update => 2 * units,
    }
}

/// How homes are chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum HomePolicy {
    /// The first units, in order, covering `params` of the model states' bytes live on the
    /// host, and those covering `optimizer` (at least as many) keep their optimizer there.
    Static { params: f64, optimizer: f64 },
    /// As many states as possible stay on the device: units leave it one at a time
    /// (optimizer first, largest first; then parameters, first units first, whose copies
    /// wait longest between forward and backward) until every moment fits the budget.
    /// `params_may_leave: false` keeps every unit's parameters on the device.
    Auto { params_may_leave: bool },
}

/// What a plan is computed from.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub units: Vec<UnitStates>,
    /// Per unit, the units whose parameters it reads (itself first).
    pub needs: Vec<Vec<usize>>,
    /// Per moment of [`step_moments`], bytes on the device that are not model states
    /// (activations, temporaries); zeros where unknown.
    pub non_model: Vec<u64>,
    pub device_budget: Option<u64>,
    pub host_budget: Option<u64>,
    /// How many moments ahead parameter copies are started, where they fit.
    pub prefetch: usize,
}

/// Bytes moved per step between device and host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Traffic {
    pub to_device: u64,
    pub to_host: u64,
}

impl Traffic {
    pub fn total(&self) -> u64 {
        self.to_device + self.to_host
    }
}

/// Homes and the residency of parameter copies for one step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub homes: Vec<Home>,
    /// Per moment, the host-homed units whose parameters are on the device during it
    /// (those it reads, those kept for later, those being prefetched).
    pub resident: Vec<Vec<usize>>,
    /// Per moment, the units whose parameters are copied to the device while it runs.
    pub prefetch: Vec<Vec<usize>>,
    /// Per moment, every byte the plan places on the device (non-model bytes included).
    pub device_bytes: Vec<u64>,
    pub host_bytes: u64,
    pub traffic: Traffic,
}

impl Plan {
    pub fn device_peak(&self) -> u64 {
        self.device_bytes.iter().copied().max().unwrap_or(0)
    }
}

/// Why a set of homes does not fit.
struct DoesNotFit(String);

impl PlanInput {
    fn check(&self) -> Result<()> {
        let n = self.units.len();
        if self.needs.len() != n || self.needs.iter().flatten().any(|&u| u >= n) {
            return Err(Error::Engine(format!("placement: needs for {} units, {n} units", self.needs.len())));
        }
        if self.non_model.len() != 2 * n + 1 {
            return Err(Error::Engine(format!(
                "placement: {} non-model figures for the {} moments of a step",
                self.non_model.len(),
                2 * n + 1
            )));
        }
        Ok(())
    }

    fn reads(&self, moment: Moment) -> &[usize] {
        match moment {
            Moment::Forward(k) | Moment::Backward(k) => &self.needs[k],
            Moment::Update => &[],
        }
    }

    /// Per unit, the moments between which its gradient exists on the device when it is not
    /// homed there: from the first backward that reads it to the last.
    fn grad_spans(&self) -> Vec<Option<(usize, usize)>> {
        let n = self.units.len();
        let mut spans: Vec<Option<(usize, usize)>> = vec![None; n];
        for k in (0..n).rev() {
            let t = moment_index(n, Moment::Backward(k));
            for &u in &self.needs[k] {
                let span = spans[u].get_or_insert((t, t));
                span.1 = t;
            }
        }
        spans
    }

    /// Simulates one step under `homes`: which copies are resident when, and the bytes.
    fn simulate(&self, homes: &[Home]) -> std::result::Result<Plan, DoesNotFit> {
        let n = self.units.len();
        let moments = step_moments(n);
        let host_bytes: u64 = self.units.iter().zip(homes).map(|(s, &h)| s.host_resident(h)).sum();
        if let Some(budget) = self.host_budget.filter(|&b| host_bytes > b) {
            return Err(DoesNotFit(format!("the host needs {host_bytes} bytes of a budget of {budget}")));
        }
        let persistent: u64 = self.units.iter().zip(homes).map(|(s, &h)| s.device_resident(h)).sum();
        let spans = self.grad_spans();
        let on_host = |u: usize| homes[u] == Home::Host;
        let size = |u: usize| self.units[u].params;
        // The next moment at or after `t` that reads unit `u` in this step (none: never).
        let next_use = |u: usize, t: usize| {
            (t..moments.len()).find(|&s| self.reads(moments[s]).contains(&u)).unwrap_or(usize::MAX)
        };
        let mut traffic = Traffic::default();
        let mut resident: BTreeSet<usize> = BTreeSet::new();
        let (mut resident_at, mut prefetch_at, mut device_bytes) = (vec![], vec![], vec![]);
        for (t, &moment) in moments.iter().enumerate() {
            let transient_grads: u64 = (0..n)
                .filter(|&u| homes[u] != Home::Device && spans[u].is_some_and(|(a, b)| a <= t && t <= b))
                .map(|u| self.units[u].grads)
                .sum();
            // The device's updates run one unit at a time: the largest scratch is the peak.
            let scratch = match moment {
                Moment::Update => {
                    (0..n).filter(|&u| homes[u] == Home::Device).map(|u| self.units[u].update_scratch).max()
                }
                _ => None,
            };
            let fixed = persistent + transient_grads + self.non_model[t] + scratch.unwrap_or(0);
            let budget = self.device_budget.unwrap_or(u64::MAX);
            let room = budget.saturating_sub(fixed);
            let need: BTreeSet<usize> = self.reads(moment).iter().copied().filter(|&u| on_host(u)).collect();
            let need_bytes: u64 = need.iter().map(|&u| size(u)).sum();
            if fixed + need_bytes > budget {
                return Err(DoesNotFit(format!(
                    "{moment:?} needs {need_bytes} bytes of parameters on the device beside {fixed} \
                     (resident states {persistent}, gradients {transient_grads}, non-model {}) of a budget of {}",
                    self.non_model[t],
                    self.device_budget.unwrap_or(0)
                )));
            }
            // Furthest next use leaves first, until the copies this moment reads fit.
            let held = |r: &BTreeSet<usize>| r.union(&need).map(|&u| size(u)).sum::<u64>();
            while held(&resident) > room {
                // What this moment reads fits alone (checked above), so a victim exists.
                let Some(victim) =
                    resident.iter().copied().filter(|u| !need.contains(u)).max_by_key(|&u| next_use(u, t))
                else {
                    break;
                };
                resident.remove(&victim);
            }
            traffic.to_device += need.iter().filter(|u| !resident.contains(u)).map(|&u| size(u)).sum::<u64>();
            resident.extend(&need);
            // Copies for the next moments start now where they fit beside what is held.
            let mut prefetch = vec![];
            for &ahead in moments.iter().skip(t + 1).take(self.prefetch) {
                for &u in self.reads(ahead).iter().filter(|&&u| on_host(u)) {
                    if !resident.contains(&u) && held(&resident) + size(u) <= room {
                        resident.insert(u);
                        prefetch.push(u);
                        traffic.to_device += size(u);
                    }
                }
            }
            device_bytes.push(fixed + resident.iter().map(|&u| size(u)).sum::<u64>());
            resident_at.push(resident.iter().copied().collect());
            prefetch_at.push(prefetch);
            if moment == Moment::Update {
                // The host's update makes every copy stale.
                resident.clear();
            }
        }
        for (s, &h) in self.units.iter().zip(homes) {
            if h != Home::Device {
                traffic.to_host += s.grads;
            }
            if h == Home::OptimizerOnHost {
                traffic.to_device += s.params;
            }
        }
        Ok(Plan {
            homes: homes.to_vec(),
            resident: resident_at,
            prefetch: prefetch_at,
            device_bytes,
            host_bytes,
            traffic,
        })
    }
}

/// The placement of `input`'s units under `policy`, or an error with the numbers when no
/// placement the policy allows fits the budgets.
pub fn plan(input: &PlanInput, policy: &HomePolicy) -> Result<Plan> {
    input.check()?;
    let n = input.units.len();
    let refuse = |DoesNotFit(why): DoesNotFit| Error::Config(format!("the model's states do not fit: {why}"));
    match *policy {
        HomePolicy::Static { params, optimizer } => {
            let total: u64 = input.units.iter().map(UnitStates::total).sum();
            let mut homes = vec![Home::Device; n];
            let mut covered = 0u64;
            for (home, s) in homes.iter_mut().zip(&input.units) {
                let share = covered as f64 / total.max(1) as f64;
                if share < params {
                    *home = Home::Host;
                } else if share < optimizer.max(params) {
                    *home = Home::OptimizerOnHost;
                }
                covered += s.total();
            }
            input.simulate(&homes).map_err(refuse)
        }
        HomePolicy::Auto { params_may_leave } => {
            let mut homes = vec![Home::Device; n];
            let mut by_size: Vec<usize> = (0..n).collect();
            by_size.sort_by_key(|&u| std::cmp::Reverse(input.units[u].optimizer + input.units[u].grads));
            let demotions = by_size
                .into_iter()
                .map(|u| (u, Home::OptimizerOnHost))
                .chain((0..n).filter(|_| params_may_leave).map(|u| (u, Home::Host)));
            let mut last = input.simulate(&homes);
            for (u, home) in demotions {
                if last.is_ok() {
                    break;
                }
                homes[u] = home;
                last = input.simulate(&homes);
            }
            last.map_err(refuse)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(sizes: &[u64], budget: u64) -> PlanInput {
        let n = sizes.len();
        PlanInput {
            units: sizes
                .iter()
                .map(|&p| UnitStates { params: p, grads: p, optimizer: 2 * p, update_scratch: 0 })
                .collect(),
            needs: (0..n).map(|k| vec![k]).collect(),
            non_model: vec![0; 2 * n + 1],
            device_budget: Some(budget),
            host_budget: None,
            prefetch: 0,
        }
    }

    #[test]
    fn moments_run_forward_then_backward_in_reverse_then_the_update() {
        let m = step_moments(3);
        assert_eq!(m.len(), 7);
        for (i, &moment) in m.iter().enumerate() {
            assert_eq!(moment_index(3, moment), i);
        }
        assert_eq!(m[3], Moment::Backward(2));
    }

    #[test]
    fn everything_stays_on_the_device_when_it_fits() {
        let p = plan(&input(&[10, 10, 10], 120), &HomePolicy::Auto { params_may_leave: true }).unwrap();
        assert_eq!(p.homes, vec![Home::Device; 3]);
        assert_eq!(p.traffic.total(), 0);
        assert_eq!(p.device_peak(), 120);
    }

    #[test]
    fn auto_moves_optimizer_state_before_parameters_and_stays_within_the_budget() {
        let i = input(&[10, 10, 10], 80);
        let p = plan(&i, &HomePolicy::Auto { params_may_leave: true }).unwrap();
        assert!(p.homes.iter().all(|&h| h != Home::Host), "{:?}", p.homes);
        assert!(p.device_peak() <= 80);
        let tight = plan(&input(&[10, 10, 10], 25), &HomePolicy::Auto { params_may_leave: true }).unwrap();
        assert!(tight.homes.contains(&Home::Host));
        assert!(tight.device_peak() <= 25);
        let never = plan(&input(&[10, 10, 10], 25), &HomePolicy::Auto { params_may_leave: false });
        assert!(never.unwrap_err().to_string().contains("do not fit"));
    }

    #[test]
    fn a_budget_below_one_units_working_set_is_refused_with_the_numbers() {
        let err = plan(&input(&[10, 40], 45), &HomePolicy::Static { params: 1.0, optimizer: 1.0 }).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("Backward(1)") && text.contains("budget of 45"), "{text}");
    }
}
