//! The stage split: contiguous unit ranges, balanced from per-unit costs (the slowest stage
//! as fast as possible, every rank's stages together within its memory budget) by an exact
//! dynamic program and, where a rank runs several stages, a search; or given by hand and
//! checked.
//!
//! Owns the split. Must not measure costs or run stages: callers (the executor, `strata
//! train`) bring the per-unit costs, and the executor runs the stages returned.
use crate::{Error, Result};

/// What one unit costs its stage: time of its forward and backward, and bytes it holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnitCost {
    /// Time of its forward and backward, in seconds.
    pub seconds: f64,
    /// Model states.
    pub bytes: u64,
    /// What the unit's forward keeps for its backward, per micro-batch.
    pub activation_bytes: u64,
}

/// Stages as half-open unit ranges `[start, end)`, in order.
pub type Stages = Vec<(usize, usize)>;

fn refuse<T>(message: String) -> Result<T> {
    Err(Error::Config(format!("pipeline stages: {message}")))
}

/// Prefix sums of the units' costs, so any range's cost is one subtraction.
struct Prefix {
    seconds: Vec<f64>,
    bytes: Vec<u64>,
    activations: Vec<u64>,
}

impl Prefix {
    fn new(units: &[UnitCost]) -> Prefix {
        let mut out = Prefix { seconds: vec![0.0], bytes: vec![0], activations: vec![0] };
        for u in units {
            out.seconds.push(out.seconds[out.seconds.len() - 1] + u.seconds);
            out.bytes.push(out.bytes[out.bytes.len() - 1] + u.bytes);
            out.activations.push(out.activations[out.activations.len() - 1] + u.activation_bytes);
        }
        out
    }

    fn seconds(&self, a: usize, b: usize) -> f64 {
        self.seconds[b] - self.seconds[a]
    }

    /// Units `a..b` on a stage that holds `held` micro-batches of their activations.
    fn bytes(&self, a: usize, b: usize, held: u64) -> u64 {
        (self.bytes[b] - self.bytes[a]).saturating_add(held.saturating_mul(self.activations[b] - self.activations[a]))
    }
}

/// The split of `units` into `stages` contiguous ranges, stage `s` run by rank `s % ranks`
/// (`ranks < stages`: the interleaved schedule's chunks), whose slowest stage is fastest
/// with each rank's bytes within `budget`: its stages' model states plus `held[s]`
/// micro-batches of stage `s`'s activations (as many as the schedule has it hold at once).
/// An exact dynamic program finds the best split with each stage alone within the budget
/// (ties go to the split whose earlier stages end first); where a rank runs several stages
/// and that split overfills one, a search finds the least slowest-stage time at which some
/// split fits every rank.
pub fn balance(units: &[UnitCost], stages: usize, ranks: usize, budget: Option<u64>, held: &[u64]) -> Result<Stages> {
    balance_searching(units, stages, ranks, budget, held, RankSearch::MOST_PLACES)
}

/// [`balance`] with a search that gives up after `most_places` places: then it keeps the
/// better of what it found and the split giving each stage an equal share of its rank's
/// budget.
fn balance_searching(
    units: &[UnitCost],
    stages: usize,
    ranks: usize,
    budget: Option<u64>,
    held: &[u64],
    most_places: usize,
) -> Result<Stages> {
    let n = units.len();
    if stages == 0 || stages > n {
        return refuse(format!("{stages} stages for {n} units: each stage needs at least one unit"));
    }
    if ranks == 0 || !stages.is_multiple_of(ranks) {
        return refuse(format!("{stages} stages do not spread evenly over {ranks} ranks"));
    }
    if held.len() != stages {
        return refuse(format!("{} held counts for {stages} stages", held.len()));
    }
    let prefix = Prefix::new(units);
    let by_stage = slowest_stage_first(&prefix, stages, budget, held)?;
    let Some(budget) = budget else { return Ok(by_stage) };
    let search = RankSearch { prefix: &prefix, ranks, budget, held, most_places };
    if search.fits(&by_stage) {
        return Ok(by_stage);
    }
    let slowest = |s: &Stages| s.iter().map(|&(a, b)| prefix.seconds(a, b)).fold(0.0, f64::max);
    // Fitting only grows with the time a stage may take: bisect the ranges' times from the
    // per-stage optimum, which no split that fits every rank can beat.
    let floor = slowest(&by_stage);
    let mut limits: Vec<f64> =
        (0..n).flat_map(|a| (a + 1..=n).map(move |b| (a, b))).map(|(a, b)| prefix.seconds(a, b)).collect();
    limits.retain(|&t| t >= floor);
    limits.sort_by(f64::total_cmp);
    limits.dedup();
    let (mut low, mut high, mut found, mut gave_up) = (0, limits.len(), None, false);
    while low < high {
        let mid = (low + high) / 2;
        match search.split_within(limits[mid]) {
            Searched::Found(split) => {
                found = Some(split);
                high = mid;
            }
            Searched::NoneFits => low = mid + 1,
            Searched::GaveUp => {
                gave_up = true;
                low = mid + 1;
            }
        }
    }
    if gave_up {
        // Each stage given its rank's budget over the stages the rank runs always fits.
        let shares = slowest_stage_first(&prefix, stages, Some(budget / (stages / ranks) as u64), held).ok();
        found = match (found, shares) {
            (Some(a), Some(b)) => Some(if slowest(&b) < slowest(&a) { b } else { a }),
            (a, b) => a.or(b),
        };
        tracing::warn!(
            "the search for {stages} stages over {ranks} ranks stopped before proving its split the fastest"
        );
    }
    found.ok_or_else(|| {
        let what = if gave_up { "found no split" } else { "no split" };
        Error::Config(format!(
            "pipeline stages: {what} of {n} units into {stages} stages over {ranks} ranks keeps every rank within {budget} bytes"
        ))
    })
}

/// The exact dynamic program: the split whose slowest stage is fastest with each stage's
/// bytes, on its own, within `budget` (every rank's, where each runs one stage).
fn slowest_stage_first(prefix: &Prefix, stages: usize, budget: Option<u64>, held: &[u64]) -> Result<Stages> {
    let n = prefix.seconds.len() - 1;
    let fits = |s: usize, a: usize, b: usize| budget.is_none_or(|limit| prefix.bytes(a, b, held[s]) <= limit);
    // slowest[k][j]: the best slowest-stage time of units 0..j in k stages; cut[k][j]: where
    // the last of those stages starts.
    let mut slowest = vec![vec![f64::INFINITY; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    slowest[0][0] = 0.0;
    for k in 1..=stages {
        for j in k..=n {
            for i in (k - 1)..j {
                if !slowest[k - 1][i].is_finite() || !fits(k - 1, i, j) {
                    continue;
                }
                let candidate = slowest[k - 1][i].max(prefix.seconds(i, j));
                if candidate < slowest[k][j] {
                    slowest[k][j] = candidate;
                    cut[k][j] = i;
                }
            }
        }
    }
    if !slowest[stages][n].is_finite() {
        let limit = budget.unwrap_or(0);
        return refuse(format!("no split of {n} units into {stages} stages keeps every stage within {limit} bytes"));
    }
    let mut out = Vec::with_capacity(stages);
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = cut[k][end];
        out.push((start, end));
        end = start;
    }
    out.reverse();
    Ok(out)
}

/// Finds splits that keep the bytes of each rank, which runs several stages, within a
/// budget.
struct RankSearch<'a> {
    prefix: &'a Prefix,
    ranks: usize,
    budget: u64,
    held: &'a [u64],
    /// Places a search tries before it gives up.
    most_places: usize,
}

/// What a search for a split within a time limit found.
enum Searched {
    Found(Stages),
    NoneFits,
    /// It tried [`RankSearch::most_places`] places without an answer.
    GaveUp,
}

/// A depth-first search's state: the cuts so far (where each stage starts, then where the
/// next one does), each rank's bytes so far, and the places (next stage, its start, the
/// ranks' bytes) from which no split fits.
struct Walk {
    cuts: Vec<usize>,
    bytes: Vec<u64>,
    failed: std::collections::HashSet<(usize, usize, Vec<u64>)>,
}

impl RankSearch<'_> {
    /// Places a balance's searches try before they give up, so that it takes seconds at
    /// most.
    const MOST_PLACES: usize = 200_000;

    fn fits(&self, split: &Stages) -> bool {
        let mut bytes = vec![0u64; self.ranks];
        for (s, &(a, b)) in split.iter().enumerate() {
            bytes[s % self.ranks] = bytes[s % self.ranks].saturating_add(self.prefix.bytes(a, b, self.held[s]));
        }
        bytes.iter().all(|&b| b <= self.budget)
    }

    /// A split whose every stage takes at most `limit` seconds and every rank's bytes fit,
    /// earlier stages ending first.
    fn split_within(&self, limit: f64) -> Searched {
        let mut walk = Walk { cuts: vec![0], bytes: vec![0; self.ranks], failed: Default::default() };
        match self.place(limit, &mut walk) {
            Some(true) => Searched::Found(walk.cuts.windows(2).map(|w| (w[0], w[1])).collect()),
            Some(false) => Searched::NoneFits,
            None => Searched::GaveUp,
        }
    }

    /// Whether the walk's cuts extend to a split that fits; `None`: gave up.
    fn place(&self, limit: f64, walk: &mut Walk) -> Option<bool> {
        let (stages, n) = (self.held.len(), self.prefix.seconds.len() - 1);
        let (stage, start) = (walk.cuts.len() - 1, walk.cuts[walk.cuts.len() - 1]);
        if stage == stages {
            return Some(start == n);
        }
        let place = (stage, start, walk.bytes.clone());
        if walk.failed.contains(&place) {
            return Some(false);
        }
        if walk.failed.len() > self.most_places {
            return None;
        }
        let rank = stage % self.ranks;
        let later = stage + 1..stages;
        // The ranks of the stages after this one, and the fewest micro-batches those hold.
        let later_ranks: Vec<usize> = (0..self.ranks).filter(|&r| later.clone().any(|s| s % self.ranks == r)).collect();
        let fewest_held = later.clone().map(|s| self.held[s]).min().unwrap_or(0);
        // The last stage takes every unit left.
        let first_end = if later.is_empty() { n } else { start + 1 };
        for end in first_end..=n - later.len() {
            let taken = walk.bytes[rank].saturating_add(self.prefix.bytes(start, end, self.held[stage]));
            // Time and bytes grow with `end`: no longer stage fits.
            if self.prefix.seconds(start, end) > limit || taken > self.budget {
                break;
            }
            // The stages after this one cannot take the time or the bytes left.
            let room = later_ranks
                .iter()
                .map(|&r| self.budget - if r == rank { taken } else { walk.bytes[r] })
                .fold(0u64, u64::saturating_add);
            if self.prefix.seconds(end, n) > later.len() as f64 * limit * (1.0 + 1e-12)
                || self.prefix.bytes(end, n, fewest_held) > room
            {
                continue;
            }
            let kept = std::mem::replace(&mut walk.bytes[rank], taken);
            walk.cuts.push(end);
            match self.place(limit, walk) {
                Some(false) => {}
                other => return other,
            }
            walk.cuts.pop();
            walk.bytes[rank] = kept;
        }
        walk.failed.insert(place);
        Some(false)
    }
}

/// Checks a hand split of `units` units into `stages` ranges: contiguous, in order, none
/// empty, every unit in exactly one.
pub fn check(split: &[(usize, usize)], units: usize, stages: usize) -> Result<Stages> {
    if split.len() != stages {
        return refuse(format!("{} ranges given for {stages} stages", split.len()));
    }
    let mut expected = 0;
    for (k, &(start, end)) in split.iter().enumerate() {
        if start != expected {
            let what = if start > expected { "skips" } else { "repeats" };
            return refuse(format!("stage {k} starts at unit {start}: the split {what} unit {}", start.min(expected)));
        }
        if end <= start {
            return refuse(format!("stage {k} [{start}, {end}) holds no unit"));
        }
        expected = end;
    }
    if expected != units {
        return refuse(format!("the stages end at unit {expected}, the model has {units} units"));
    }
    Ok(split.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(seconds: &[f64]) -> Vec<UnitCost> {
        seconds.iter().map(|&s| UnitCost { seconds: s, bytes: 1, activation_bytes: 0 }).collect()
    }

    /// Every split of `n` units into `k` stages, to check the program against.
    fn every_split(n: usize, k: usize) -> Vec<Stages> {
        if k == 1 {
            return vec![vec![(0, n)]];
        }
        let mut out = Vec::new();
        for first_end in 1..=n - (k - 1) {
            for rest in every_split(n - first_end, k - 1) {
                let mut s = vec![(0, first_end)];
                s.extend(rest.iter().map(|(a, b)| (a + first_end, b + first_end)));
                out.push(s);
            }
        }
        out
    }

    #[test]
    fn the_balance_is_the_best_of_every_split() {
        let units = costs(&[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]);
        let slowest =
            |s: &Stages| s.iter().map(|&(a, b)| units[a..b].iter().map(|u| u.seconds).sum::<f64>()).fold(0.0, f64::max);
        for k in 1..=8 {
            let best = balance(&units, k, k, None, &vec![0; k]).unwrap();
            assert_eq!(check(&best, 8, k).unwrap(), best, "a balance is a valid split");
            let optimum = every_split(8, k).iter().map(slowest).fold(f64::INFINITY, f64::min);
            assert_eq!(slowest(&best), optimum, "{k} stages");
        }
    }

    #[test]
    fn the_memory_budget_moves_the_cut() {
        // Time alone splits 2+2 | 4; with units 0 and 1 heavy in memory they cannot share.
        let mut units = costs(&[2.0, 2.0, 4.0]);
        assert_eq!(balance(&units, 2, 2, None, &[0; 2]).unwrap(), [(0, 2), (2, 3)]);
        units[0].bytes = 10;
        units[1].bytes = 10;
        assert_eq!(balance(&units, 2, 2, Some(11), &[0; 2]).unwrap(), [(0, 1), (1, 3)]);
        assert!(balance(&units, 2, 2, Some(5), &[0; 2]).unwrap_err().to_string().contains("within 5 bytes"));
    }

    #[test]
    fn activations_held_by_each_stage_count_against_the_budget() {
        // Time alone splits 1+1 | 2. Each unit keeps 10 bytes per micro-batch; under 1F1B on
        // 2 stages the first holds 2 micro-batches and the second 1: two units on the first
        // stage need 40 bytes, one unit 20, and the second stage's two units 20.
        let mut units = costs(&[1.0, 1.0, 2.0]);
        units.iter_mut().for_each(|u| (u.bytes, u.activation_bytes) = (0, 10));
        assert_eq!(balance(&units, 2, 2, Some(25), &[0, 0]).unwrap(), [(0, 2), (2, 3)]);
        assert_eq!(balance(&units, 2, 2, Some(25), &[2, 1]).unwrap(), [(0, 1), (1, 3)]);
        assert_eq!(balance(&units, 2, 2, Some(40), &[2, 1]).unwrap(), [(0, 2), (2, 3)]);
        assert!(balance(&units, 2, 2, Some(19), &[2, 1]).is_err());
    }

    /// The slowest stage of `split`, and whether every rank's bytes fit `budget` with stage
    /// `s` on rank `s % ranks`.
    fn judge(units: &[UnitCost], split: &Stages, ranks: usize, budget: u64, held: &[u64]) -> (f64, bool) {
        let (mut bytes, mut slowest) = (vec![0u64; ranks], 0.0f64);
        for (s, &(a, b)) in split.iter().enumerate() {
            slowest = slowest.max(units[a..b].iter().map(|u| u.seconds).sum());
            bytes[s % ranks] += units[a..b].iter().map(|u| u.bytes + held[s] * u.activation_bytes).sum::<u64>();
        }
        (slowest, bytes.iter().all(|&b| b <= budget))
    }

    proptest::proptest! {
        #[test]
        fn several_stages_per_rank_fit_each_rank_as_fast_as_the_best_split_that_fits(
            table in proptest::collection::vec((1u32..20, 0u64..10, 0u64..4), 4..10),
            ranks in 2usize..4,
            budget in 4u64..60,
        ) {
            let units: Vec<UnitCost> = table
                .iter()
                .map(|&(s, b, a)| UnitCost { seconds: f64::from(s), bytes: b, activation_bytes: a })
                .collect();
            let stages = 2 * ranks;
            proptest::prop_assume!(stages <= units.len());
            // The interleaved schedule has earlier chunks hold more micro-batches.
            let held: Vec<u64> = (0..stages).map(|s| (stages - s).div_ceil(ranks) as u64).collect();
            let best = every_split(units.len(), stages)
                .iter()
                .map(|s| judge(&units, s, ranks, budget, &held))
                .filter(|(_, fits)| *fits)
                .map(|(slowest, _)| slowest)
                .reduce(f64::min);
            match (balance(&units, stages, ranks, Some(budget), &held), best) {
                (Ok(split), Some(best)) => {
                    proptest::prop_assert_eq!(check(&split, units.len(), stages).unwrap(), split.clone());
                    let (slowest, fits) = judge(&units, &split, ranks, budget, &held);
                    proptest::prop_assert!(fits, "{:?} exceeds {} bytes on a rank", split, budget);
                    proptest::prop_assert_eq!(slowest, best, "{:?}", split);
                }
                (Err(e), None) => proptest::prop_assert!(e.to_string().contains("bytes"), "{}", e),
                (got, best) => proptest::prop_assert!(false, "balance gave {:?}, the best split takes {:?}", got, best),
            }
            // A search that gives up at once still never overfills a rank: it falls back on
            // equal shares of each rank's budget, or refuses.
            match balance_searching(&units, stages, ranks, Some(budget), &held, 0) {
                Ok(split) => {
                    let (slowest, fits) = judge(&units, &split, ranks, budget, &held);
                    proptest::prop_assert!(fits, "{:?} exceeds {} bytes on a rank", split, budget);
                    proptest::prop_assert!(best.is_some_and(|b| slowest >= b), "{:?} beats the best split", split);
                }
                Err(e) => proptest::prop_assert!(e.to_string().contains("bytes"), "{}", e),
            }
        }
    }

    #[test]
    fn a_rank_holding_two_stages_counts_both_against_its_budget() {
        // Each stage alone fits 10 bytes; the split by slowest stage puts units 0 and 2,
        // 6 bytes each, on rank 0. Units 1 and 3 are light, so moving the cuts keeps rank 0
        // within budget at a slower rank.
        let mut units = costs(&[1.0, 1.0, 1.0, 1.0, 1.0]);
        for (u, b) in units.iter_mut().zip([6, 1, 6, 1, 1]) {
            u.bytes = b;
        }
        let by_stage = balance(&units, 4, 4, Some(10), &[0; 4]).unwrap();
        let split = balance(&units, 4, 2, Some(10), &[0; 4]).unwrap();
        let (_, fits) = judge(&units, &by_stage, 2, 10, &[0; 4]);
        assert!(!fits, "the stage-by-stage split {by_stage:?} should overfill a rank");
        let (_, fits) = judge(&units, &split, 2, 10, &[0; 4]);
        assert!(fits, "{split:?} overfills a rank");
        assert!(balance(&units, 4, 2, Some(6), &[0; 4]).unwrap_err().to_string().contains("over 2 ranks"));
    }

    #[test]
    fn bad_splits_are_refused_by_name() {
        assert!(balance(&costs(&[1.0, 1.0]), 3, 3, None, &[0; 3])
            .unwrap_err()
            .to_string()
            .contains("3 stages for 2 units"));
        assert!(balance(&costs(&[1.0, 1.0]), 2, 2, None, &[0]).unwrap_err().to_string().contains("1 held counts"));
        let err = |s: &[(usize, usize)]| check(s, 9, 2).unwrap_err().to_string();
        assert!(err(&[(0, 4), (5, 9)]).contains("skips unit 4"));
        assert!(err(&[(0, 5), (4, 9)]).contains("repeats unit 4"));
        assert!(err(&[(0, 5), (5, 8)]).contains("the model has 9 units"));
        assert!(err(&[(0, 9)]).contains("1 ranges given for 2 stages"));
        assert!(err(&[(0, 0), (0, 9)]).contains("holds no unit"));
    }
}
