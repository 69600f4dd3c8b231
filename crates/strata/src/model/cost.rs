//! What a unit costs per token, declared by its family where the unit is built
//! ([`super::UnitBuilder::declare_cost`]): the values it keeps for its backward and the
//! attention it runs. The memory estimate, the step-time model and the strategy search read
//! these; a unit that declares none is refused there by name, never guessed.

/// What one unit keeps for its backward per token of a micro-batch, in fp32 values:
/// `values` whatever the sequence's length plus `scores` per position attended (attention
/// probabilities, one per head, where attention is not fused); `output` is the width of
/// the unit's output, which a recomputed block keeps alone.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Kept {
    /// Values kept per token whatever the sequence's length.
    pub values: f64,
    /// The part of `values` over the vocabulary (logits, their softmax and gradients).
    pub vocab_values: f64,
    /// Values kept per attended position (attention probabilities, one per head).
    pub scores: f64,
    /// The width of the unit's output: what a recomputed block keeps alone.
    pub output: f64,
    /// A repeated block: what `checkpoint` recomputes.
    pub block: bool,
}

impl Kept {
    /// A repeated block keeping `values` per token, `heads` attention probabilities per
    /// attended position, with an output `output` wide.
    pub fn block(values: f64, heads: i64, output: i64) -> Kept {
        Kept { values, vocab_values: 0.0, scores: heads as f64, output: output as f64, block: true }
    }

    /// A head over `vocab` entries: `values` off the vocabulary, and the logits, their
    /// log-softmax and the gradient pair the loss's backward writes (four values per entry).
    pub fn head(values: f64, vocab: i64) -> Kept {
        let over_vocab = 4.0 * vocab as f64;
        Kept { values: values + over_vocab, vocab_values: over_vocab, scores: 0.0, output: vocab as f64, block: false }
    }

    /// The same, keeping dropout's masks as well: `masked` elements per token dropped at
    /// one byte of mask each; where `probabilities` are dropped too, their dropped copy
    /// (which the weighted sum keeps) and its mask beside the probabilities.
    pub fn with_dropout(self, masked: f64, probabilities: bool) -> Kept {
        let dropped = if probabilities { 1.25 * self.scores } else { 0.0 };
        Kept { values: self.values + masked / 4.0, scores: self.scores + dropped, ..self }
    }

    /// A unit reading the batch: its token ids and targets (four fp32-sized values per
    /// token), with an output `dim` wide.
    pub fn ids(dim: i64) -> Kept {
        Kept { values: 4.0, vocab_values: 0.0, scores: 0.0, output: dim as f64, block: false }
    }
}

/// A unit's cost per token.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UnitCost {
    /// What the unit keeps for its backward per token.
    pub kept: Kept,
    /// The summed width (heads × head width) of the attentions the unit runs: each unit of
    /// width costs 4 FLOPs per attended position in the forward (scores and weighted sums),
    /// beside the 2 per weight its products cost.
    pub attention_width: f64,
    /// The unit looks its weights up (an embedding table): they cost no products.
    pub looks_up: bool,
    /// Weights of the unit a token is not multiplied by (the experts a router did not
    /// choose for it): held and trained, but no FLOPs of that token.
    pub idle_weights: f64,
}

impl UnitCost {
    /// A unit without attention, multiplying by its weights.
    pub fn keeping(kept: Kept) -> UnitCost {
        UnitCost { kept, attention_width: 0.0, looks_up: false, idle_weights: 0.0 }
    }

    /// A unit keeping `kept` and running attentions of `width` in all.
    pub fn attending(kept: Kept, width: i64) -> UnitCost {
        UnitCost { kept, attention_width: width as f64, looks_up: false, idle_weights: 0.0 }
    }

    /// An embedding: rows of its tables looked up for the batch's ids, `dim` wide.
    pub fn looking_up(kept: Kept) -> UnitCost {
        UnitCost { kept, attention_width: 0.0, looks_up: true, idle_weights: 0.0 }
    }
}
