//! Which stores the arena collectives write their slots with. Ordinary stores leave a
//! slot in this core's cache, where a peer sharing that cache reads it at once. Streaming
//! stores send it to memory, which is slower for a peer that shares the cache, but not
//! slowed by where the peer's core sits. On a 2-core virtual machine, arena collectives
//! with cached slots ran for whole phases at a third of their usual bandwidth while
//! streaming slots ran at full speed (the likely cause: cores that stop sharing a cache,
//! so every line a peer reads crosses the chip). Which case holds cannot be known in
//! advance and can change while a job runs, so each rank measures both on its large
//! collectives of each kind (all-reduce, reduce-scatter, all-gather) and keeps the
//! faster, trying the other again now and then; either choice moves the same bytes.
//! `STRATA_SHM_SLOT_STORES=cached|streaming` fixes the choice instead.
use crate::{Error, Result};

/// The variable that fixes the choice (`auto`, the default, measures).
pub(crate) const SLOT_STORES_VAR: &str = "STRATA_SHM_SLOT_STORES";

/// How a rank writes the slots its peers read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotStores {
    /// Ordinary stores: the slot stays in this core's cache.
    Cached,
    /// Non-temporal stores: the slot goes to memory.
    Streaming,
}

impl SlotStores {
    fn index(self) -> usize {
        self as usize
    }

    fn other(self) -> SlotStores {
        match self {
            SlotStores::Cached => SlotStores::Streaming,
            SlotStores::Streaming => SlotStores::Cached,
        }
    }
}

/// Collectives moving fewer bytes than this use cached stores and are not measured: the
/// slots' contents stay in cache whichever core reads them, and their timings are too
/// short to compare.
const MEASURED_FROM: usize = 4 << 20;
/// The first this many measured collectives alternate between the kinds of stores, so
/// that the first choice rests on three timings of each.
const FIRST_TRIES: u64 = 6;
/// Each kind of stores is judged by the median of its last this many bandwidths: one
/// cold or disturbed call does not decide, and a change shows after two.
const KEPT: usize = 3;
/// Every this many measured collectives, the stores not preferred are tried again, so that
/// a change in where the cores sit is followed.
const RETRY_EVERY: u64 = 32;

/// Streaming stores are chosen only when they reach this many times the cached stores'
/// bandwidth: where cores share a cache, cached stores were the faster by a third, and
/// timings that differ by less than the noise of a shared machine must not flip the
/// choice; in the slow phases, streaming stores were three to four times as fast.
const STREAMING_MARGIN: f64 = 1.25;

/// The bandwidths of one kind of stores' last [`KEPT`] measured collectives.
#[derive(Clone, Debug, Default)]
struct Recent {
    rates: [f64; KEPT],
    count: usize,
}

impl Recent {
    fn push(&mut self, rate: f64) {
        self.rates[self.count % KEPT] = rate;
        self.count += 1;
    }

    fn median(&self) -> Option<f64> {
        let mut kept = self.rates[..self.count.min(KEPT)].to_vec();
        kept.sort_by(f64::total_cmp);
        kept.get(kept.len() / 2).copied()
    }
}

/// The choice between [`SlotStores`], from the bandwidth each reached on this rank.
#[derive(Clone, Debug, Default)]
pub(crate) struct SlotStoreChoice {
    /// Set by [`SLOT_STORES_VAR`]: the stores every collective uses, measured or not.
    fixed: Option<SlotStores>,
    measured_calls: u64,
    /// Bytes per second of each kind of stores on its recent collectives.
    recent: [Recent; 2],
}

impl SlotStoreChoice {
    /// The choice [`SLOT_STORES_VAR`]'s `value` asks for (unset means `auto`).
    pub(crate) fn from_setting(value: Option<&str>) -> Result<SlotStoreChoice> {
        let fixed = match value.unwrap_or("auto") {
            "auto" => None,
            "cached" => Some(SlotStores::Cached),
            "streaming" => Some(SlotStores::Streaming),
            other => {
                return Err(Error::Comm(format!("{SLOT_STORES_VAR}={other:?} is not one of auto, cached, streaming")))
            }
        };
        Ok(SlotStoreChoice { fixed, ..SlotStoreChoice::default() })
    }

    /// The stores for the next collective, which moves `bytes` bytes: each kind in turn
    /// for the first [`FIRST_TRIES`] measured calls, then the faster, but the other on
    /// every [`RETRY_EVERY`]-th measured call.
    pub(crate) fn next(&self, bytes: usize) -> SlotStores {
        if let Some(fixed) = self.fixed {
            return fixed;
        }
        if bytes < MEASURED_FROM {
            return SlotStores::Cached;
        }
        if self.measured_calls < FIRST_TRIES {
            return if self.measured_calls.is_multiple_of(2) { SlotStores::Cached } else { SlotStores::Streaming };
        }
        let best = match (self.recent[0].median(), self.recent[1].median()) {
            (Some(cached), Some(streaming)) if streaming > STREAMING_MARGIN * cached => SlotStores::Streaming,
            _ => SlotStores::Cached,
        };
        if self.measured_calls % RETRY_EVERY == RETRY_EVERY - 1 {
            best.other()
        } else {
            best
        }
    }

    /// Records that a collective of `bytes` bytes written with `stores` took `seconds`.
    pub(crate) fn record(&mut self, stores: SlotStores, bytes: usize, seconds: f64) {
        if bytes < MEASURED_FROM || seconds <= 0.0 {
            return;
        }
        self.measured_calls += 1;
        self.recent[stores.index()].push(bytes as f64 / seconds);
    }
}

/// The arena collectives, each with its own [`SlotStoreChoice`]: their bandwidths differ
/// for the same bytes, so they are not compared with one another.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ArenaCollective {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// One [`SlotStoreChoice`] per [`ArenaCollective`].
pub(crate) struct SlotStoreChoices([SlotStoreChoice; 3]);

impl SlotStoreChoices {
    /// As [`SlotStoreChoice::from_setting`], for each collective.
    pub(crate) fn from_setting(value: Option<&str>) -> Result<SlotStoreChoices> {
        let choice = SlotStoreChoice::from_setting(value)?;
        Ok(SlotStoreChoices([choice.clone(), choice.clone(), choice]))
    }

    pub(crate) fn of(&mut self, which: ArenaCollective) -> &mut SlotStoreChoice {
        &mut self.0[which as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SlotStores::{Cached, Streaming};

    /// Runs `calls` collectives of 64 MiB whose seconds per kind of stores come from
    /// `cost(call, stores)`; returns the stores each used.
    fn run(choice: &mut SlotStoreChoice, calls: usize, cost: impl Fn(usize, SlotStores) -> f64) -> Vec<SlotStores> {
        (0..calls)
            .map(|call| {
                let stores = choice.next(64 << 20);
                choice.record(stores, 64 << 20, cost(call, stores));
                stores
            })
            .collect()
    }

    #[test]
    fn small_collectives_use_cached_stores_and_are_not_measured() {
        let mut choice = SlotStoreChoice::default();
        choice.record(Cached, 64 << 20, 1.0);
        choice.record(Streaming, 64 << 20, 0.001);
        assert_eq!(choice.next(1 << 20), Cached);
        choice.record(Cached, 1 << 20, 1e-9);
        assert_eq!(choice.recent[Cached.index()].median(), Some((64 << 20) as f64));
    }

    #[test]
    fn the_variable_fixes_the_stores_for_every_size() {
        for (value, stores) in [("cached", Cached), ("streaming", Streaming)] {
            let mut choice = SlotStoreChoice::from_setting(Some(value)).unwrap();
            assert_eq!(run(&mut choice, 40, |_, s| if s == stores { 1.0 } else { 0.001 }), vec![stores; 40]);
            assert_eq!(choice.next(4096), stores);
        }
        assert_eq!(SlotStoreChoice::from_setting(None).unwrap().next(4096), Cached);
        let e = SlotStoreChoice::from_setting(Some("nt")).unwrap_err().to_string();
        assert!(e.contains("STRATA_SHM_SLOT_STORES=\"nt\" is not one of auto, cached, streaming"), "{e}");
    }

    #[test]
    fn both_are_tried_then_the_faster_is_kept_and_the_other_retried() {
        let mut choice = SlotStoreChoice::default();
        let used = run(&mut choice, 96, |_, s| if s == Streaming { 0.01 } else { 0.03 });
        assert_eq!(&used[..7], &[Cached, Streaming, Cached, Streaming, Cached, Streaming, Streaming]);
        let retried: Vec<usize> = (0..used.len()).filter(|&i| i >= 6 && used[i] == Cached).collect();
        assert_eq!(retried, [31, 63, 95], "the slower stores are tried once per {RETRY_EVERY} calls");
    }

    #[test]
    fn streaming_stores_must_be_clearly_faster_to_be_chosen() {
        for (streaming_seconds, expected) in [(0.85, Cached), (0.75, Streaming)] {
            let mut choice = SlotStoreChoice::default();
            let used = run(&mut choice, 20, |_, s| if s == Streaming { streaming_seconds } else { 1.0 });
            assert!(used[6..].iter().all(|&s| s == expected), "{streaming_seconds}: {used:?}");
        }
    }

    #[test]
    fn stores_that_turn_slower_are_left_within_two_calls() {
        // Cached stores are fast for the first 40 calls, then three times slower than
        // streaming ones (cores that stopped sharing a cache); streaming ones never change.
        let mut choice = SlotStoreChoice::default();
        let used = run(&mut choice, 100, |call, s| match s {
            Cached if call < 40 => 0.01,
            Cached => 0.06,
            Streaming => 0.02,
        });
        let before: Vec<_> = (6..40).map(|i| if i == 31 { Streaming } else { Cached }).collect();
        assert_eq!(used[6..40], before[..], "cached, retrying streaming once at call 31");
        assert_eq!(&used[40..43], &[Cached, Cached, Streaming], "two slow calls make the median slow");
        assert!(used[42..63].iter().all(|&s| s == Streaming), "{used:?}");
        assert_eq!(used[63], Cached, "retried");
    }

    #[test]
    fn stores_that_turn_faster_are_found_by_the_retries() {
        // Streaming stores are the faster until call 40, then cached ones become six times
        // faster: the retries at calls 63 and 95 bring two fast timings into their median.
        let mut choice = SlotStoreChoice::default();
        let used = run(&mut choice, 110, |call, s| match s {
            Cached if call < 40 => 0.03,
            Cached => 0.005,
            Streaming => 0.01,
        });
        assert!(used[6..95].iter().enumerate().all(|(i, &s)| (s == Cached) == [31, 63].contains(&(i + 6))), "{used:?}");
        assert_eq!(used[95], Cached);
        assert!(used[96..].iter().all(|&s| s == Cached), "{used:?}");
    }
}
