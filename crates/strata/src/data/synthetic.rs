//! The embedded default corpus: text from a seeded first-order Markov chain. Every symbol
//! has four possible successors with probabilities 1/2, 1/4, 1/8, 1/8, so the best possible
//! next-token loss is known exactly (the chain's entropy rate, about 1.2130 nats) and a
//! run on it shows how close training gets, with nothing to download.

/// A tiny deterministic generator (SplitMix64). Written here rather than taken from a crate
/// because the corpus and the shuffles must be bit-identical on every platform and for
/// every future version, which general-purpose RNG crates do not promise.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0), by rejection so there is no modulo bias.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// Successor probabilities of every symbol, as powers of two so sampling is exact.
const BRANCH_LOG2: [u32; 4] = [1, 2, 3, 3];

/// Parameters of the synthetic corpus.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticCorpus {
    /// Seeds the chain's successors and every draw.
    pub seed: u64,
    /// Tokens generated.
    pub tokens: usize,
    /// Symbols used: byte values `first..first + alphabet` (printable ASCII by default).
    pub first: u32,
    /// Symbols in the chain (at least 4 are used).
    pub alphabet: u32,
}

impl Default for SyntheticCorpus {
    fn default() -> Self {
        SyntheticCorpus { seed: 1234, tokens: 1 << 20, first: 32, alphabet: 64 }
    }
}

impl SyntheticCorpus {
    /// The lowest mean cross-entropy (nats per token) any model can reach on this corpus.
    pub fn best_loss(&self) -> f64 {
        BRANCH_LOG2.iter().map(|&k| (k as f64) * std::f64::consts::LN_2 / f64::from(1u32 << k)).sum()
    }

    /// Generates the token stream.
    pub fn generate(&self) -> super::TokenData {
        let mut rng = SplitMix64::new(self.seed);
        let n = self.alphabet.max(BRANCH_LOG2.len() as u32);
        let successors: Vec<[u32; 4]> = (0..n)
            .map(|_| {
                let mut all: Vec<u32> = (0..n).collect();
                rng.shuffle(&mut all);
                [all[0], all[1], all[2], all[3]]
            })
            .collect();
        let mut state = rng.below(u64::from(n)) as u32;
        let mut tokens = Vec::with_capacity(self.tokens);
        for _ in 0..self.tokens {
            tokens.push(self.first + state);
            // Draw with probability 2^-k for branch i: one uniform 3-bit number decides.
            let r = rng.below(8) as u32;
            let branch = match r {
                0..=3 => 0,
                4..=5 => 1,
                6 => 2,
                _ => 3,
            };
            state = successors[state as usize][branch];
        }
        super::TokenData::new(tokens, "the synthetic corpus")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_loss_is_the_entropy_of_the_branching() {
        let h = 0.5 * 2f64.ln() + 0.25 * 4f64.ln() + 2.0 * 0.125 * 8f64.ln();
        assert!((SyntheticCorpus::default().best_loss() - h).abs() < 1e-12);
    }

    #[test]
    fn corpus_is_deterministic_and_has_the_promised_statistics() {
        let c = SyntheticCorpus { tokens: 200_000, ..Default::default() };
        let a = c.generate().to_vec();
        assert_eq!(a, c.generate().to_vec());
        assert!(a.iter().all(|&t| (32..96).contains(&t)));
        // Empirical conditional entropy of the bigram statistics matches the promise.
        let mut counts = std::collections::HashMap::<(u32, u32), f64>::new();
        let mut totals = std::collections::HashMap::<u32, f64>::new();
        for w in a.windows(2) {
            *counts.entry((w[0], w[1])).or_default() += 1.0;
            *totals.entry(w[0]).or_default() += 1.0;
        }
        let n = (a.len() - 1) as f64;
        let h: f64 = counts.iter().map(|(&(p, _), &c)| -(c / n) * (c / totals[&p]).ln()).sum();
        assert!((h - c.best_loss()).abs() < 0.01, "empirical {h} vs {}", c.best_loss());
    }
}
