//! The stage split: contiguous unit ranges, balanced from per-unit costs by an exact dynamic
//! program (the slowest stage as fast as possible, every stage within its memory budget),
//! or given by hand and checked.
use crate::{Error, Result};

/// What one unit costs its stage: time of its forward and backward, and bytes it holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnitCost {
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

/// The split of `units` into `stages` contiguous ranges whose slowest stage is fastest,
/// each stage's bytes within `budget`: its units' model states plus `held[s]` micro-batches
/// of their activations (as many as the schedule has stage `s` hold at once); ties go to
/// the split whose earlier stages end first.
pub fn balance(units: &[UnitCost], stages: usize, budget: Option<u64>, held: &[u64]) -> Result<Stages> {
    let n = units.len();
    if stages == 0 || stages > n {
        return refuse(format!("{stages} stages for {n} units: each stage needs at least one unit"));
    }
    if held.len() != stages {
        return refuse(format!("{} held counts for {stages} stages", held.len()));
    }
    let prefix_seconds: Vec<f64> = std::iter::once(0.0)
        .chain(units.iter().scan(0.0, |s, u| {
            *s += u.seconds;
            Some(*s)
        }))
        .collect();
    let prefix_bytes: Vec<u64> = std::iter::once(0)
        .chain(units.iter().scan(0u64, |s, u| {
            *s += u.bytes;
            Some(*s)
        }))
        .collect();
    let prefix_activations: Vec<u64> = std::iter::once(0)
        .chain(units.iter().scan(0u64, |s, u| {
            *s += u.activation_bytes;
            Some(*s)
        }))
        .collect();
    // Stage `s` holding units a..b.
    let fits = |s: usize, a: usize, b: usize| {
        let activations = held[s].saturating_mul(prefix_activations[b] - prefix_activations[a]);
        budget.is_none_or(|limit| (prefix_bytes[b] - prefix_bytes[a]).saturating_add(activations) <= limit)
    };
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
                let candidate = slowest[k - 1][i].max(prefix_seconds[j] - prefix_seconds[i]);
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
            let best = balance(&units, k, None, &vec![0; k]).unwrap();
            assert_eq!(check(&best, 8, k).unwrap(), best, "a balance is a valid split");
            let optimum = every_split(8, k).iter().map(slowest).fold(f64::INFINITY, f64::min);
            assert_eq!(slowest(&best), optimum, "{k} stages");
        }
    }

    #[test]
    fn the_memory_budget_moves_the_cut() {
        // Time alone splits 2+2 | 4; with units 0 and 1 heavy in memory they cannot share.
        let mut units = costs(&[2.0, 2.0, 4.0]);
        assert_eq!(balance(&units, 2, None, &[0; 2]).unwrap(), [(0, 2), (2, 3)]);
        units[0].bytes = 10;
        units[1].bytes = 10;
        assert_eq!(balance(&units, 2, Some(11), &[0; 2]).unwrap(), [(0, 1), (1, 3)]);
        assert!(balance(&units, 2, Some(5), &[0; 2]).unwrap_err().to_string().contains("within 5 bytes"));
    }

    #[test]
    fn activations_held_by_each_stage_count_against_the_budget() {
        // Time alone splits 1+1 | 2. Each unit keeps 10 bytes per micro-batch; under 1F1B on
        // 2 stages the first holds 2 micro-batches and the second 1: two units on the first
        // stage need 40 bytes, one unit 20, and the second stage's two units 20.
        let mut units = costs(&[1.0, 1.0, 2.0]);
        units.iter_mut().for_each(|u| (u.bytes, u.activation_bytes) = (0, 10));
        assert_eq!(balance(&units, 2, Some(25), &[0, 0]).unwrap(), [(0, 2), (2, 3)]);
        assert_eq!(balance(&units, 2, Some(25), &[2, 1]).unwrap(), [(0, 1), (1, 3)]);
        assert_eq!(balance(&units, 2, Some(40), &[2, 1]).unwrap(), [(0, 2), (2, 3)]);
        assert!(balance(&units, 2, Some(19), &[2, 1]).is_err());
    }

    #[test]
    fn bad_splits_are_refused_by_name() {
        assert!(balance(&costs(&[1.0, 1.0]), 3, None, &[0; 3])
            .unwrap_err()
            .to_string()
            .contains("3 stages for 2 units"));
        assert!(balance(&costs(&[1.0, 1.0]), 2, None, &[0]).unwrap_err().to_string().contains("1 held counts"));
        let err = |s: &[(usize, usize)]| check(s, 9, 2).unwrap_err().to_string();
        assert!(err(&[(0, 4), (5, 9)]).contains("skips unit 4"));
        assert!(err(&[(0, 5), (4, 9)]).contains("repeats unit 4"));
        assert!(err(&[(0, 5), (5, 8)]).contains("the model has 9 units"));
        assert!(err(&[(0, 9)]).contains("1 ranges given for 2 stages"));
        assert!(err(&[(0, 0), (0, 9)]).contains("holds no unit"));
    }
}
