//! Which stores the arena collectives write their slots with. Ordinary stores leave a
//! slot in this core's cache, where a peer sharing that cache reads it at once. Streaming
//! stores send it to memory, which is slower for a peer that shares the cache, but not
//! slowed by where the peer's core sits. On a 2-core virtual machine, arena collectives
//! with cached slots ran for whole phases at a third of their usual bandwidth while
//! streaming slots ran at full speed (the likely cause: cores that stop sharing a cache,
//! so every line a peer reads crosses the chip). Which case holds cannot be known in
//! advance and can change while a job runs, so rank 0 times both on the large calls of
//! each collective (all-reduce, reduce-scatter, all-gather, broadcast; below 64 MiB and
//! above apart), keeps the faster and tries the other again now and then. It publishes
//! each call's stores one call ahead, so the whole group writes its slots alike (mixed
//! stores would still move the same bytes).
//! `STRATA_SHM_SLOT_STORES=cached|streaming` fixes a rank's stores instead.
use crate::{Error, Result};
use std::ffi::OsStr;

/// The variable that fixes a rank's stores (`auto`, the default, follows rank 0's
/// measurements).
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

    /// As published in the shared segment.
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> SlotStores {
        if code == SlotStores::Streaming.code() {
            SlotStores::Streaming
        } else {
            SlotStores::Cached
        }
    }

    fn other(self) -> SlotStores {
        match self {
            SlotStores::Cached => SlotStores::Streaming,
            SlotStores::Streaming => SlotStores::Cached,
        }
    }
}

/// Calls moving fewer bytes than this (all of a call's inputs or outputs, every rank's
/// together) use cached stores and are not measured: the slots' contents stay in cache
/// whichever core reads them, and their timings are too short to compare.
const MEASURED_FROM: usize = 4 << 20;

/// Whether a call moving `bytes` bytes is measured (and its stores chosen by rank 0).
pub(crate) fn measured(bytes: usize) -> bool {
    bytes >= MEASURED_FROM
}
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

/// The choice between [`SlotStores`] for the measured calls of one collective, from the
/// bandwidth each reached.
#[derive(Clone, Debug, Default)]
pub(crate) struct SlotStoreChoice {
    /// Set by [`SLOT_STORES_VAR`]: the stores every call uses, measured or not.
    fixed: Option<SlotStores>,
    /// Bytes per second of each kind of stores on its recent calls.
    recent: [Recent; 2],
}

impl SlotStoreChoice {
    /// The choice [`SLOT_STORES_VAR`]'s `value` asks for (unset means `auto`).
    pub(crate) fn from_setting(value: Option<&OsStr>) -> Result<SlotStoreChoice> {
        let fixed = match value.map(OsStr::to_str) {
            None | Some(Some("auto")) => None,
            Some(Some("cached")) => Some(SlotStores::Cached),
            Some(Some("streaming")) => Some(SlotStores::Streaming),
            Some(_) => {
                let shown = value.unwrap_or_default();
                return Err(Error::Comm(format!("{SLOT_STORES_VAR}={shown:?} is not one of auto, cached, streaming")));
            }
        };
        Ok(SlotStoreChoice { fixed, ..SlotStoreChoice::default() })
    }

    /// The stores [`SLOT_STORES_VAR`] fixed, if it did.
    pub(crate) fn fixed(&self) -> Option<SlotStores> {
        self.fixed
    }

    /// The stores for measured call `call` (counted from 0) from the timings recorded so
    /// far: each kind in turn for the first [`FIRST_TRIES`] calls, then the faster, but
    /// the other on every [`RETRY_EVERY`]-th call.
    pub(crate) fn decide(&self, call: u64) -> SlotStores {
        if let Some(fixed) = self.fixed {
            return fixed;
        }
        if call < FIRST_TRIES {
            return if call.is_multiple_of(2) { SlotStores::Cached } else { SlotStores::Streaming };
        }
        let median = |stores: SlotStores| self.recent[stores.index()].median();
        let best = match (median(SlotStores::Cached), median(SlotStores::Streaming)) {
            (Some(cached), Some(streaming)) if streaming > STREAMING_MARGIN * cached => SlotStores::Streaming,
            _ => SlotStores::Cached,
        };
        if call % RETRY_EVERY == RETRY_EVERY - 1 {
            best.other()
        } else {
            best
        }
    }

    /// Records that a measured call of `bytes` bytes written with `stores` took `seconds`.
    pub(crate) fn record(&mut self, stores: SlotStores, bytes: usize, seconds: f64) {
        if seconds > 0.0 {
            self.recent[stores.index()].push(bytes as f64 / seconds);
        }
    }
}

/// The arena collectives, each with its own [`SlotStoreChoice`]s: their bandwidths differ
/// for the same bytes, so they are not compared with one another.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ArenaCollective {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
}

/// How many [`ArenaCollective`]s there are (the last one's index + 1).
const ARENA_COLLECTIVES: usize = ArenaCollective::Broadcast as usize + 1;

/// Measured calls from this many bytes on are chosen for apart from smaller ones: the
/// faster stores can differ between calls whose data partly stays in the last-level cache
/// and calls far larger than it.
const LARGE_FROM: usize = 64 << 20;

/// The choices kept apart: each [`ArenaCollective`], below and from [`LARGE_FROM`].
pub(crate) const CHOICES: usize = 2 * ARENA_COLLECTIVES;

/// Which choice a measured call of `which` moving `bytes` bytes belongs to.
pub(crate) fn choice_index(which: ArenaCollective, bytes: usize) -> usize {
    2 * which as usize + usize::from(bytes >= LARGE_FROM)
}

/// Per [`choice_index`]: its [`SlotStoreChoice`] and how many measured calls it made (the
/// same count on every rank, as every rank makes the same calls).
pub(crate) struct SlotStoreChoices([(SlotStoreChoice, u64); CHOICES]);

impl SlotStoreChoices {
    /// As [`SLOT_STORES_VAR`] in this process's environment asks.
    pub(crate) fn from_env() -> Result<SlotStoreChoices> {
        SlotStoreChoices::from_setting(std::env::var_os(SLOT_STORES_VAR).as_deref())
    }

    /// As [`SlotStoreChoice::from_setting`], for each choice.
    pub(crate) fn from_setting(value: Option<&OsStr>) -> Result<SlotStoreChoices> {
        let choice = SlotStoreChoice::from_setting(value)?;
        Ok(SlotStoreChoices(std::array::from_fn(|_| (choice.clone(), 0))))
    }

    /// Choice `index`'s stores and the number of its next measured call.
    pub(crate) fn of(&mut self, index: usize) -> (&mut SlotStoreChoice, &mut u64) {
        let (choice, calls) = &mut self.0[index];
        (choice, calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SlotStores::{Cached, Streaming};

    /// Runs `calls` measured calls of 64 MiB whose seconds per kind of stores come from
    /// `cost(call, stores)`, deciding each call's stores before the previous call is
    /// recorded, as rank 0 does; returns the stores each used.
    fn run(choice: &mut SlotStoreChoice, calls: u64, cost: impl Fn(u64, SlotStores) -> f64) -> Vec<SlotStores> {
        let mut next = choice.decide(0);
        (0..calls)
            .map(|call| {
                let stores = next;
                next = choice.decide(call + 1);
                choice.record(stores, 64 << 20, cost(call, stores));
                stores
            })
            .collect()
    }

    #[test]
    fn only_calls_of_4_mib_or_more_are_measured_and_64_mib_apart() {
        assert!(!measured((4 << 20) - 1));
        assert!(measured(4 << 20));
        use ArenaCollective::{AllGather, AllReduce, Broadcast, ReduceScatter};
        let all = [AllReduce, ReduceScatter, AllGather, Broadcast];
        let indices: Vec<usize> = all
            .iter()
            .flat_map(|&w| [choice_index(w, 4 << 20), choice_index(w, (64 << 20) - 1), choice_index(w, 64 << 20)])
            .collect();
        assert_eq!(indices, [0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7]);
        assert_eq!(CHOICES, 8);
    }

    #[test]
    fn the_variable_fixes_the_stores() {
        for (value, stores) in [("cached", Cached), ("streaming", Streaming)] {
            let mut choice = SlotStoreChoice::from_setting(Some(OsStr::new(value))).unwrap();
            assert_eq!(choice.fixed(), Some(stores));
            assert_eq!(run(&mut choice, 40, |_, s| if s == stores { 1.0 } else { 0.001 }), vec![stores; 40]);
        }
        for value in [None, Some(OsStr::new("auto"))] {
            let choice = SlotStoreChoice::from_setting(value).unwrap();
            assert_eq!(choice.fixed(), None);
            assert_eq!([choice.decide(0), choice.decide(1)], [Cached, Streaming], "{value:?} measures");
        }
        let e = SlotStoreChoice::from_setting(Some(OsStr::new("nt"))).unwrap_err().to_string();
        assert!(e.contains("STRATA_SHM_SLOT_STORES=\"nt\" is not one of auto, cached, streaming"), "{e}");
    }

    #[test]
    fn both_are_tried_then_the_faster_is_kept_and_the_other_retried() {
        let mut choice = SlotStoreChoice::default();
        let used = run(&mut choice, 96, |_, s| if s == Streaming { 0.01 } else { 0.03 });
        assert_eq!(&used[..7], &[Cached, Streaming, Cached, Streaming, Cached, Streaming, Streaming]);
        let retried: Vec<usize> = (6..used.len()).filter(|&i| used[i] == Cached).collect();
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
    fn stores_that_turn_slower_are_left_within_three_calls() {
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
        // Call 43 is decided once calls 40 and 41 are in: two slow calls make the median slow.
        assert_eq!(&used[40..44], &[Cached, Cached, Cached, Streaming], "{used:?}");
        assert!(used[43..63].iter().all(|&s| s == Streaming), "{used:?}");
        assert_eq!(used[63], Cached, "retried");
        assert!(used[64..95].iter().all(|&s| s == Streaming), "{used:?}");
        assert_eq!(used[95], Cached, "retried");
    }

    #[test]
    fn stores_that_turn_faster_are_found_by_the_retries() {
        // Streaming stores are the faster until call 40, then cached ones become six times
        // faster: the retries at calls 63 and 95 bring two fast timings into their median,
        // and call 97 is the first decided after the second is in.
        let mut choice = SlotStoreChoice::default();
        let used = run(&mut choice, 110, |call, s| match s {
            Cached if call < 40 => 0.03,
            Cached => 0.005,
            Streaming => 0.01,
        });
        let streaming_then: Vec<_> =
            (6..97).map(|i| if [31, 63, 95].contains(&i) { Cached } else { Streaming }).collect();
        assert_eq!(used[6..97], streaming_then[..], "{used:?}");
        assert!(used[97..].iter().all(|&s| s == Cached), "{used:?}");
    }
}
