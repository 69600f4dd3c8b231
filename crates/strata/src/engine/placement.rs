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
    /// Everything on the host, where the unit also computes (PatrickStar's
    /// `use_cpu_embedding`): its input comes to the host and its output goes to the device;
    /// nothing of its states ever does. Only for a unit no other unit reads.
    HostCompute,
}

impl Home {
    /// Whether the unit's gradient is made on the device and sent to the host after its
    /// backward.
    pub fn sends_grads(self) -> bool {
        matches!(self, Home::OptimizerOnHost | Home::Host)
    }

    /// Whether the unit's parameters live on the host (the device holds copies at most).
    pub fn params_on_host(self) -> bool {
        matches!(self, Home::Host | Home::HostCompute)
    }
}

/// Bytes of one unit's model states: parameters as the unit computes with them, their
/// gradient (zero for a frozen unit) and the optimizer's state (masters and moments).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UnitStates {
    /// The parameters, as the unit computes with them.
    pub params: u64,
    /// The gradient (zero for a frozen unit).
    pub grads: u64,
    /// The optimizer's state (masters and moments).
    pub optimizer: u64,
    /// Bytes the update of this unit borrows for its duration where it runs (fp32 copies
    /// of low-precision parameters and gradients).
    pub update_scratch: u64,
}

impl UnitStates {
    /// Parameters, gradient and optimizer state together.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    /// Bytes held on the device between uses under `home`.
    pub fn device_resident(&self, home: Home) -> u64 {
        match home {
            Home::Device => self.total(),
            Home::OptimizerOnHost => self.params,
            Home::Host | Home::HostCompute => 0,
        }
    }

    /// Bytes held on the host under `home` (the host copy of the parameters is the master).
    pub fn host_resident(&self, home: Home) -> u64 {
        match home {
            Home::Device => 0,
            Home::OptimizerOnHost | Home::Host | Home::HostCompute => self.total(),
        }
    }
}

/// A moment of a step, in the order the engine runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Moment {
    /// Unit `k`'s forward.
    Forward(usize),
    /// Unit `k`'s backward.
    Backward(usize),
    /// The optimizer's update, after every backward.
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
    Static {
        /// Fraction of the bytes, from the first unit on, whose units live on the host.
        params: f64,
        /// Fraction of the bytes, likewise, whose units keep their optimizer on the host.
        optimizer: f64,
    },
    /// States stay on the device where that moves fewer bytes: units leave it whole for the
    /// host, one at a time, largest first, until every moment fits the budget, and further
    /// where that lowers the bytes moved per step. `params_may_leave:
    /// false` keeps every unit's parameters on the device (only the optimizer leaves).
    Auto {
        /// Whether units' parameters may leave the device, or only their optimizer.
        params_may_leave: bool,
    },
}

/// What a plan is computed from.
#[derive(Clone, Debug)]
pub struct PlanInput {
    /// Each unit's state bytes, in unit order.
    pub units: Vec<UnitStates>,
    /// Per unit, the units whose parameters it reads (itself first).
    pub needs: Vec<Vec<usize>>,
    /// Per moment of [`step_moments`], bytes on the device that are not model states
    /// (activations, temporaries); zeros where unknown.
    pub non_model: Vec<u64>,
    /// Bytes the device may hold; `None` for no limit.
    pub device_budget: Option<u64>,
    /// Bytes of host memory the model states may take; `None` for no limit.
    pub host_budget: Option<u64>,
    /// How many moments ahead parameter copies are started, where they fit.
    pub prefetch: usize,
    /// Per unit, whether it lives on the host whatever the policy says (empty: none); it
    /// computes there too unless another unit reads its parameters.
    pub on_host: Vec<bool>,
    /// The device copies of host-homed states come in whole slots of this many bytes
    /// ([`super::slots`]); 1: in their own bytes.
    pub slot_bytes: u64,
    /// Host-homed gradients have a twin of their size: a delayed update reads one while the
    /// next step's backward fills the other.
    pub delayed_update: bool,
}

/// Bytes moved per step between device and host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Traffic {
    /// Bytes of parameters copied to the device.
    pub to_device: u64,
    /// Bytes of gradients copied to the host.
    pub to_host: u64,
}

impl Traffic {
    /// Bytes moved both ways.
    pub fn total(&self) -> u64 {
        self.to_device + self.to_host
    }
}

/// Homes and the residency of parameter copies for one step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// Each unit's home.
    pub homes: Vec<Home>,
    /// Per moment, the host-homed units whose parameters are on the device during it
    /// (those it reads, those kept for later, those being prefetched).
    pub resident: Vec<Vec<usize>>,
    /// Per moment, the units whose parameters are copied to the device while it runs.
    pub prefetch: Vec<Vec<usize>>,
    /// Per moment, every byte the plan places on the device (non-model bytes included).
    pub device_bytes: Vec<u64>,
    /// The most bytes of slots the copies of host-homed states take at any moment: the
    /// size of the slot pool.
    pub slot_peak: u64,
    /// Bytes of one slot of the pool (1: copies take their own bytes).
    pub slot_bytes: u64,
    /// Bytes held on the host: host-homed states, with a delayed update's gradient twins.
    pub host_bytes: u64,
    /// Bytes moved per step between device and host.
    pub traffic: Traffic,
}

impl Plan {
    /// The most bytes the plan places on the device at any moment.
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

    /// Every unit on the device, but those that live on the host whatever the policy says:
    /// they compute there too where no other unit reads their parameters and they read no
    /// other unit's (which lives on the device, or is copied there).
    fn initial_homes(&self) -> Vec<Home> {
        let shares = |u: usize| {
            self.needs[u].iter().any(|&v| v != u)
                || self.needs.iter().enumerate().any(|(k, reads)| k != u && reads.contains(&u))
        };
        (0..self.units.len())
            .map(|u| match self.on_host.get(u).copied() {
                Some(true) if shares(u) => Home::Host,
                Some(true) => Home::HostCompute,
                _ => Home::Device,
            })
            .collect()
    }

    /// Bytes of the slots a device copy of `bytes` takes.
    fn in_slots(&self, bytes: u64) -> u64 {
        bytes.next_multiple_of(self.slot_bytes.max(1))
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
        let twin = |s: &UnitStates, h: Home| if self.delayed_update && h != Home::Device { s.grads } else { 0 };
        let host_bytes: u64 = self.units.iter().zip(homes).map(|(s, &h)| s.host_resident(h) + twin(s, h)).sum();
        if let Some(budget) = self.host_budget.filter(|&b| host_bytes > b) {
            return Err(DoesNotFit(format!("the host needs {host_bytes} bytes of a budget of {budget}")));
        }
        let persistent: u64 = self.units.iter().zip(homes).map(|(s, &h)| s.device_resident(h)).sum();
        let spans = self.grad_spans();
        // A parameter copy takes whole slots; what is copied is the parameters' own bytes.
        let size = |u: usize| self.in_slots(self.units[u].params);
        let copied = |u: usize| self.units[u].params;
        let budget = self.device_budget.unwrap_or(u64::MAX);
        // Per moment: the host-homed copies it reads, the bytes beside all copies, and the
        // room left for copies kept for later.
        let mut needs: Vec<Vec<usize>> = vec![];
        let mut fixed = vec![];
        let mut room = vec![];
        let mut grad_slots = vec![];
        for (t, &moment) in moments.iter().enumerate() {
            let transient_grads: u64 = (0..n)
                .filter(|&u| homes[u].sends_grads() && spans[u].is_some_and(|(a, b)| a <= t && t <= b))
                .map(|u| self.in_slots(self.units[u].grads))
                .sum();
            grad_slots.push(transient_grads);
            // The device's updates run one unit at a time: the largest scratch is the peak.
            let scratch = match moment {
                Moment::Update => {
                    (0..n).filter(|&u| homes[u] == Home::Device).map(|u| self.units[u].update_scratch).max()
                }
                _ => None,
            };
            let beside = persistent + transient_grads + self.non_model[t] + scratch.unwrap_or(0);
            let need: Vec<usize> = self.reads(moment).iter().copied().filter(|&u| homes[u] == Home::Host).collect();
            let need_bytes: u64 = need.iter().map(|&u| size(u)).sum();
            if beside + need_bytes > budget {
                return Err(DoesNotFit(format!(
                    "{moment:?} needs {need_bytes} bytes of parameters on the device beside {beside} \
                     (resident states {persistent}, gradients {transient_grads}, non-model {}) of a budget of {budget}",
                    self.non_model[t],
                )));
            }
            room.push(budget - beside - need_bytes);
            fixed.push(beside);
            needs.push(need);
        }
        let kept = keep_between_uses(&needs, &room, &Sizes { space: &size, worth: &copied });
        let mut resident: Vec<BTreeSet<usize>> = needs.iter().map(|need| need.iter().copied().collect()).collect();
        for gap in &kept {
            for r in &mut resident[gap.from + 1..gap.to] {
                r.insert(gap.unit);
            }
        }
        let mut traffic = Traffic::default();
        for u in (0..n).filter(|&u| homes[u] == Home::Host) {
            let uses = needs.iter().filter(|need| need.contains(&u)).count();
            let bridged = kept.iter().filter(|g| g.unit == u).count();
            traffic.to_device += copied(u) * (uses - bridged) as u64;
        }
        // Copies start up to `prefetch` moments early where they fit beside what is held
        // at every moment until they are read (traffic is unchanged: each is copied anyway).
        let held = |r: &BTreeSet<usize>| r.iter().map(|&u| size(u)).sum::<u64>();
        let mut prefetch = vec![vec![]; moments.len()];
        for t in 0..moments.len() {
            for ahead in t + 1..(t + 1 + self.prefetch).min(moments.len()) {
                for &u in &needs[ahead] {
                    let absent = (t..ahead).all(|s| !resident[s].contains(&u));
                    if absent && (t..ahead).all(|s| fixed[s] + held(&resident[s]) + size(u) <= budget) {
                        for r in &mut resident[t..ahead] {
                            r.insert(u);
                        }
                        prefetch[t].push(u);
                    }
                }
            }
        }
        for (s, &h) in self.units.iter().zip(homes) {
            if h.sends_grads() {
                traffic.to_host += s.grads;
            }
            if h == Home::OptimizerOnHost {
                traffic.to_device += s.params;
            }
        }
        let slot_peak = grad_slots.iter().zip(&resident).map(|(g, r)| g + held(r)).max().unwrap_or(0);
        Ok(Plan {
            homes: homes.to_vec(),
            device_bytes: fixed.iter().zip(&resident).map(|(f, r)| f + held(r)).collect(),
            slot_peak,
            slot_bytes: self.slot_bytes,
            resident: resident.into_iter().map(|r| r.into_iter().collect()).collect(),
            prefetch,
            host_bytes,
            traffic,
        })
    }
}

/// Unit `unit`'s copy stays on the device from its use at moment `from` to the next at `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Gap {
    unit: usize,
    from: usize,
    to: usize,
}

/// A copy's bytes on the device (`space`) and those copying it moves (`worth`): a copy in
/// slots takes its last slot whole.
struct Sizes<'a> {
    space: &'a dyn Fn(usize) -> u64,
    worth: &'a dyn Fn(usize) -> u64,
}

/// At most this many gaps are chosen by trying every subset; a model has one per borrowed
/// unit's extra use (a tied embedding: two).
const ENUMERATED_GAPS: usize = 12;

/// Which copies stay on the device between consecutive uses, saving the most bytes copied
/// while every moment's kept copies fit its `room`. Furthest-next-use eviction is optimal
/// only for copies of equal size; this is exact for units of any size: a unit read only by
/// its own forward and backward keeps its copy over a span that contains the spans of all
/// later such units, so the choice among them is a knapsack over nested prefixes, solved by
/// dynamic programming over the reachable sums of space; the spans of units read elsewhere
/// too (borrowed weights) are few and tried in every combination around it.
fn keep_between_uses(needs: &[Vec<usize>], room: &[u64], sizes: &Sizes) -> Vec<Gap> {
    let mut units: Vec<usize> = needs.iter().flatten().copied().collect();
    units.sort_unstable();
    units.dedup();
    let mut free = vec![];
    let mut nested = vec![];
    let mut other = vec![];
    for &u in &units {
        let uses: Vec<usize> = (0..needs.len()).filter(|&t| needs[t].contains(&u)).collect();
        let gaps: Vec<Gap> = uses.windows(2).map(|w| Gap { unit: u, from: w[0], to: w[1] }).collect();
        for gap in gaps.iter().copied() {
            match gap {
                g if g.to == g.from + 1 => free.push(g),
                g if gaps.len() == 1 => nested.push(g),
                g => other.push(g),
            }
        }
    }
    // Outermost span first: each nested span lies inside the ones before it.
    nested.sort_by_key(|g| (g.from, std::cmp::Reverse(g.to)));
    // Beyond the limit (many borrowed weights), the remaining copies are fetched again.
    let tried = &other[..other.len().min(ENUMERATED_GAPS)];
    let mut best: Option<(u64, Vec<Gap>)> = None;
    for subset in 0u32..1 << tried.len() {
        let chosen: Vec<Gap> = (0..tried.len()).filter(|i| subset & 1 << i != 0).map(|i| tried[i]).collect();
        let mut left: Vec<i128> = room.iter().map(|&r| r as i128).collect();
        for g in &chosen {
            for l in &mut left[g.from + 1..g.to] {
                *l -= (sizes.space)(g.unit) as i128;
            }
        }
        if left.iter().any(|&l| l < 0) {
            continue;
        }
        let (saved, picked) = nested_knapsack(&nested, &left, sizes);
        let total = saved + chosen.iter().map(|g| (sizes.worth)(g.unit)).sum::<u64>();
        if best.as_ref().is_none_or(|(most, _)| total > *most) {
            best = Some((total, chosen.into_iter().chain(picked).collect()));
        }
    }
    // Keeping none of the tried spans always fits, so a best exists.
    let mut kept = best.map(|(_, gaps)| gaps).unwrap_or_default();
    kept.extend(free);
    kept
}

/// The subset of `nested` spans (outermost first, each inside the previous) saving the most
/// bytes copied whose kept copies fit `left` at every moment, and those bytes.
fn nested_knapsack(nested: &[Gap], left: &[i128], sizes: &Sizes) -> (u64, Vec<Gap>) {
    // The moments each span covers beyond the next span in: the kept bytes there are the
    // sum over the spans up to it, so the tightest room there bounds that prefix.
    let limits: Vec<i128> = nested
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let inner = nested.get(i + 1).map(|h| h.from + 1..h.to);
            (g.from + 1..g.to)
                .filter(|t| inner.as_ref().is_none_or(|r| !r.contains(t)))
                .map(|t| left[t])
                .min()
                .unwrap_or(i128::MAX)
        })
        .collect();
    // After each span, per reachable sum of space kept, the most bytes saved reaching it
    // and how: (bytes saved, previous sum, kept). What comes later depends on the sum alone.
    let mut layers: Vec<std::collections::BTreeMap<u64, (u64, u64, bool)>> = vec![];
    let mut reached: Vec<(u64, u64)> = vec![(0, 0)];
    for (g, &limit) in nested.iter().zip(&limits) {
        let mut next: std::collections::BTreeMap<u64, (u64, u64, bool)> = std::collections::BTreeMap::new();
        for &(sum, saved) in &reached {
            for keep in [false, true] {
                let (after, worth) =
                    if keep { (sum + (sizes.space)(g.unit), saved + (sizes.worth)(g.unit)) } else { (sum, saved) };
                if (after as i128) <= limit && next.get(&after).is_none_or(|&(best, _, _)| worth > best) {
                    next.insert(after, (worth, sum, keep));
                }
            }
        }
        reached = next.iter().map(|(&sum, &(saved, _, _))| (sum, saved)).collect();
        layers.push(next);
    }
    let Some(&(mut sum, best)) = reached.iter().max_by_key(|&&(sum, saved)| (saved, std::cmp::Reverse(sum))) else {
        return (0, vec![]);
    };
    let mut picked = vec![];
    for (g, layer) in nested.iter().zip(&layers).rev() {
        let (_, before, keep) = layer[&sum];
        if keep {
            picked.push(*g);
        }
        sum = before;
    }
    (best, picked)
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
            let mut homes = input.initial_homes();
            let mut covered = 0u64;
            for (home, s) in homes.iter_mut().zip(&input.units) {
                let share = covered as f64 / total.max(1) as f64;
                if share < params {
                    *home = (*home).max(Home::Host);
                } else if share < optimizer.max(params) {
                    *home = (*home).max(Home::OptimizerOnHost);
                }
                covered += s.total();
            }
            input.simulate(&homes).map_err(refuse)
        }
        HomePolicy::Auto { params_may_leave } => {
            let mut homes = input.initial_homes();
            // A host home holds on the host what an optimizer-on-host home does, and on the
            // device never more (its parameter copy comes for the unit's span, not for the
            // whole step), for the same bytes moved where the copy stays between forward and
            // backward: units leave whole where they may.
            let leave = if params_may_leave { Home::Host } else { Home::OptimizerOnHost };
            // Largest first (fewest units leave); among equals the last units, whose copies
            // are kept over the shortest spans. Past the first placement that fits, the rest
            // of the order is tried too and the one that moves the fewest bytes is kept (the
            // earliest of equals): a state that leaves frees device room where copies can
            // stay between uses, so `auto` never moves more than the end of its order,
            // every state that may leave on the host.
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&u| std::cmp::Reverse((input.units[u].total(), u)));
            let mut placed = input.simulate(&homes);
            for u in order {
                homes[u] = homes[u].max(leave);
                let next = input.simulate(&homes);
                placed = match (placed, next) {
                    (Ok(best), Ok(plan)) if plan.traffic.total() < best.traffic.total() => Ok(plan),
                    (Ok(best), _) => Ok(best),
                    (Err(_), next) => next,
                };
            }
            placed.map_err(refuse)
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
            on_host: vec![],
            slot_bytes: 1,
            delayed_update: false,
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
    fn auto_moves_units_to_the_host_until_the_budget_holds_and_no_further() {
        // 40 bytes of states a unit: at 80, one unit leaving is not enough (40 + 40 resident,
        // plus its copy and gradient in its backward); two leave, and their copies are kept
        // between forward and backward (one copy each way a step).
        let p = plan(&input(&[10, 10, 10], 80), &HomePolicy::Auto { params_may_leave: true }).unwrap();
        assert_eq!(p.homes, [Home::Device, Home::Host, Home::Host]);
        assert!(p.device_peak() <= 80);
        assert_eq!(p.traffic, Traffic { to_device: 20, to_host: 20 });
        let tight = plan(&input(&[10, 10, 10], 25), &HomePolicy::Auto { params_may_leave: true }).unwrap();
        assert_eq!(tight.homes, [Home::Host; 3]);
        assert!(tight.device_peak() <= 25);
        // Parameters that may not leave: only optimizer state does, and 25 bytes cannot hold
        // three units' parameters.
        let kept = plan(&input(&[10, 10, 10], 80), &HomePolicy::Auto { params_may_leave: false }).unwrap();
        assert!(kept.homes.iter().all(|&h| h != Home::Host) && kept.homes.contains(&Home::OptimizerOnHost));
        let never = plan(&input(&[10, 10, 10], 25), &HomePolicy::Auto { params_may_leave: false });
        assert!(never.unwrap_err().to_string().contains("do not fit"));
    }

    /// The fewest parameter bytes any eviction order copies to the device in one step under
    /// `plan`'s homes and room (copies taking whole slots), by trying every choice of which
    /// copies to keep at every moment.
    fn fewest_bytes_copied(input: &PlanInput, plan: &Plan) -> u64 {
        let n = input.units.len();
        let moments = step_moments(n);
        let units = |mask: u32| (0..n).filter(move |u| mask & (1 << u) != 0);
        let size = |mask: u32| units(mask).map(|u| input.in_slots(input.units[u].params)).sum::<u64>();
        let copied = |mask: u32| units(mask).map(|u| input.units[u].params).sum::<u64>();
        let mask_of = |units: &[usize]| units.iter().fold(0u32, |m, &u| m | 1 << u);
        let budget = input.device_budget.unwrap_or(u64::MAX);
        let room: Vec<u64> =
            (0..moments.len()).map(|t| budget - (plan.device_bytes[t] - size(mask_of(&plan.resident[t])))).collect();
        let need: Vec<u32> = moments
            .iter()
            .map(|&m| {
                mask_of(&input.reads(m).iter().copied().filter(|&u| plan.homes[u] == Home::Host).collect::<Vec<_>>())
            })
            .collect();
        fn best(
            t: usize,
            held: u32,
            need: &[u32],
            room: &[u64],
            sizes: &Sizes,
            memo: &mut std::collections::HashMap<(usize, u32), u64>,
        ) -> u64 {
            if t == need.len() {
                return 0;
            }
            if let Some(&v) = memo.get(&(t, held)) {
                return v;
            }
            let mut lowest = u64::MAX;
            // Every subset of what is held may stay; what this moment reads must be there.
            let mut kept = held;
            loop {
                let present = kept | need[t];
                if (sizes.space)(present as usize) <= room[t] {
                    let after = if t == need.len() - 1 { 0 } else { present };
                    let rest = best(t + 1, after, need, room, sizes, memo);
                    lowest = lowest.min((sizes.worth)((need[t] & !kept) as usize).saturating_add(rest));
                }
                if kept == 0 {
                    break;
                }
                kept = (kept - 1) & held;
            }
            memo.insert((t, held), lowest);
            lowest
        }
        let (space, worth) = (|m: usize| size(m as u32), |m: usize| copied(m as u32));
        best(0, 0, &need, &room, &Sizes { space: &space, worth: &worth }, &mut Default::default())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        #[test]
        fn the_plan_copies_the_fewest_bytes_any_eviction_order_could(
            sizes in proptest::collection::vec(1u64..4, 2..=8),
            tied in proptest::bool::ANY,
            slack in 0u64..40,
            slot_bytes in proptest::prop_oneof![proptest::strategy::Just(1u64), 40u64..100],
        ) {
            let n = sizes.len();
            let slot = 64;
            let mut i = input(&sizes.iter().map(|s| s * slot).collect::<Vec<_>>(), u64::MAX);
            i.slot_bytes = slot_bytes;
            if tied {
                i.needs[n - 1].push(0);
            }
            let full = HomePolicy::Static { params: 1.0, optimizer: 1.0 };
            // The least budget a full offload fits, plus some slack.
            let least = (0..).map(|b| b * slot / 4).find(|&b| {
                i.device_budget = Some(b);
                plan(&i, &full).is_ok()
            });
            i.device_budget = least.map(|b| b + slack * slot / 4);
            let plan = plan(&i, &full).unwrap();
            proptest::prop_assert_eq!(plan.traffic.to_device, fewest_bytes_copied(&i, &plan), "{:?}", plan.resident);
            for (t, bytes) in plan.device_bytes.iter().enumerate() {
                proptest::prop_assert!(*bytes <= i.device_budget.unwrap(), "moment {}: {} bytes", t, bytes);
            }
            // `auto` fits wherever full offload does, copies the fewest bytes its own homes
            // allow, and never more than full offload.
            let auto = super::plan(&i, &HomePolicy::Auto { params_may_leave: true }).unwrap();
            proptest::prop_assert_eq!(auto.traffic.to_device, fewest_bytes_copied(&i, &auto), "{:?}", auto.homes);
            proptest::prop_assert!(
                auto.traffic.total() <= plan.traffic.total(),
                "auto {:?} against full {:?}",
                auto.traffic,
                plan.traffic
            );
        }
    }

    #[test]
    fn a_delayed_update_counts_the_twins_of_the_host_gradients() {
        let optimizer_on_host = HomePolicy::Static { params: 0.0, optimizer: 1.0 };
        let mut i = input(&[10, 20], u64::MAX);
        let plain = plan(&i, &optimizer_on_host).unwrap().host_bytes;
        i.delayed_update = true;
        assert_eq!(plan(&i, &optimizer_on_host).unwrap().host_bytes, plain + 30, "one twin per gradient");
        i.host_budget = Some(plain);
        let err = plan(&i, &optimizer_on_host).unwrap_err().to_string();
        assert!(err.contains(&format!("the host needs {} bytes of a budget of {plain}", plain + 30)), "{err}");
    }

    #[test]
    fn a_unit_kept_on_the_host_computes_there_unless_it_shares_parameters() {
        let mut i = input(&[10, 20, 10], 200);
        i.on_host = vec![true, false, false];
        let auto = HomePolicy::Auto { params_may_leave: true };
        let p = plan(&i, &auto).unwrap();
        assert_eq!(p.homes, [Home::HostCompute, Home::Device, Home::Device]);
        // Nothing of it comes to the device or leaves it.
        assert_eq!(p.traffic, Traffic::default());
        assert_eq!(p.device_peak(), 120, "the other units' states only");
        assert_eq!(p.host_bytes, 40);
        // Every unit on the host: only the others move.
        let full = plan(&i, &full_offload()).unwrap();
        assert_eq!(full.homes, [Home::HostCompute, Home::Host, Home::Host]);
        assert_eq!(full.traffic.to_host, 30);
        assert!(full.resident.iter().all(|r| !r.contains(&0)), "{:?}", full.resident);
        // Read by the last unit (a tied head), it is copied to the device for that unit; and
        // the head, which reads it, computes on the device too.
        i.needs[2].push(0);
        i.on_host = vec![true, false, true];
        let tied = plan(&i, &full_offload()).unwrap();
        assert_eq!(tied.homes, [Home::Host, Home::Host, Home::Host]);
        assert_eq!(tied.traffic.to_host, 40);
        assert!(tied.resident.iter().any(|r| r.contains(&0)), "{:?}", tied.resident);
    }

    fn full_offload() -> HomePolicy {
        HomePolicy::Static { params: 1.0, optimizer: 1.0 }
    }

    #[test]
    fn a_budget_below_one_units_working_set_is_refused_with_the_numbers() {
        let err = plan(&input(&[10, 40], 45), &HomePolicy::Static { params: 1.0, optimizer: 1.0 }).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("Backward(1)") && text.contains("budget of 45"), "{text}");
    }
}
