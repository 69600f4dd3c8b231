//! A text classifier of your own — an encoder written as units, its loss and its input —
//! trained on labeled records by `auto_accelerate`'s choice of strategy within a memory
//! budget.
//!
//! The records are texts the program makes (words of the letters `a`, `b` and `c`; the label
//! is the letter used most), encoded a byte a token and batched a text a row: each batch's
//! [`strata::model::RowLayout`] says where a row's padding starts, and the encoder's
//! attention reads it. The loss is cross-entropy over the classes with label smoothing
//! (`loss_func`); `prepare_input` folds upper-case letters to lower case before the model
//! sees them.
//!
//! cargo run --release -p strata --example custom_classifier
use std::sync::Arc;
use strata::auto::AutoOptions;
use strata::data::Batching;
use strata::data::{Batch, ClassifySet, LabeledText, Tokenizer};
use strata::model::layers::{
    attention, gelu, layer_norm, merge_heads, other_examples, split_heads, vocab_embedding, AttentionOptions,
};
use strata::model::{Builder, Init, ParamId, Params, TpRole, Unit};
use strata::run::{self, Data, Flow, Model, RunConfig, StrategySource};
use strata::train::StepReport;
use tch::{Kind, Tensor};

const BYTES: i64 = 256;
const LONGEST: i64 = 48;
const DIM: i64 = 32;
const HEADS: i64 = 4;
const CLASSES: [&str; 3] = ["a", "b", "c"];

/// Byte and position embeddings, summed.
struct Embedding {
    bytes: ParamId,
    positions: ParamId,
}

impl Unit for Embedding {
    fn kind(&self) -> &'static str {
        "Embedding"
    }
    fn forward(&self, p: &Params<'_>, tokens: &Tensor) -> strata::Result<Tensor> {
        let t = tokens.size()[1];
        let positions = Tensor::f_arange(t, (Kind::Int64, tokens.device()))?;
        let words = vocab_embedding(&p[self.bytes], tokens, BYTES, None, p.tp())?;
        Ok(words.f_add(&Tensor::f_embedding(&p[self.positions], &positions, -1, false, false)?)?)
    }
}

/// A pre-norm encoder block: every token attends to every token of its own text (the
/// layout hides the padding), then a feed-forward layer.
struct EncoderBlock {
    norm: (ParamId, ParamId),
    qkv: ParamId,
    out: ParamId,
    up: ParamId,
    down: ParamId,
}

impl Unit for EncoderBlock {
    fn kind(&self) -> &'static str {
        "EncoderBlock"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> strata::Result<Tensor> {
        let normed = layer_norm(x, &p[self.norm.0], &p[self.norm.1], 1e-5)?;
        let qkv = p.linear(&normed, self.qkv, None)?.f_split(DIM, 2)?;
        let heads = |t: &Tensor| split_heads(t, HEADS);
        let options = AttentionOptions { bidirectional: true, ..AttentionOptions::default() };
        let hidden = other_examples(p.layout())?;
        let attended = attention(
            &heads(&qkv[0])?,
            &heads(&qkv[1])?,
            &heads(&qkv[2])?,
            &options,
            hidden.as_ref(),
            Default::default(),
            None,
        )?;
        let x = x.f_add(&p.linear(&merge_heads(&attended)?, self.out, None)?)?;
        let h = gelu(&p.linear(&x, self.up, None)?)?;
        Ok(x.f_add(&p.linear(&h, self.down, None)?)?)
    }
}

/// The mean of each text's token vectors (its padding left out), then the classes' logits.
struct ClassifierHead {
    classes: ParamId,
}

impl Unit for ClassifierHead {
    fn kind(&self) -> &'static str {
        "ClassifierHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> strata::Result<Tensor> {
        let tokens = match p.layout() {
            // Padding belongs to an example of its own, numbered after the text's.
            Some(layout) => layout.examples.f_eq(0)?.f_unsqueeze(-1)?.f_to_kind(x.kind())?,
            None => x.f_ones_like()?.f_narrow(2, 0, 1)?,
        };
        let summed = x.f_mul(&tokens)?.f_sum_dim_intlist(1, false, None)?;
        let pooled = summed.f_div(&tokens.f_sum_dim_intlist(1, false, None)?)?;
        p.linear(&pooled, self.classes, None)
    }
}

fn encoder_classifier(b: &mut Builder) -> strata::Result<()> {
    let normal = Init::Normal { std: 0.02 };
    let mut u = b.unit("embedding");
    let bytes = u.param("embed.bytes", &[BYTES, DIM], normal, TpRole::Vocab);
    let positions = u.param("embed.positions", &[LONGEST, DIM], normal, TpRole::Replicated);
    u.finish(Embedding { bytes, positions });
    for i in 0..2 {
        let mut u = b.unit(format!("encoder.{i}"));
        let norm = (
            u.param(format!("encoder.{i}.norm.weight"), &[DIM], Init::Ones, TpRole::Replicated),
            u.param(format!("encoder.{i}.norm.bias"), &[DIM], Init::Zeros, TpRole::Replicated),
        );
        let qkv = u.linear(format!("encoder.{i}.qkv.weight"), &[3 * DIM, DIM], normal, TpRole::Column { parts: 3 });
        let out = u.linear(format!("encoder.{i}.out.weight"), &[DIM, DIM], normal, TpRole::Row);
        let up = u.linear(format!("encoder.{i}.up.weight"), &[4 * DIM, DIM], normal, TpRole::Column { parts: 1 });
        let down = u.linear(format!("encoder.{i}.down.weight"), &[DIM, 4 * DIM], normal, TpRole::Row);
        u.finish(EncoderBlock { norm, qkv, out, up, down });
    }
    let mut u = b.unit("head");
    let classes = u.linear("head.classes", &[CLASSES.len() as i64, DIM], normal, TpRole::Replicated);
    u.finish(ClassifierHead { classes });
    Ok(())
}

/// `count` texts of words over a, b and c (some in upper case), each labeled with the
/// letter it uses most (ties go to the earlier letter).
fn texts(count: usize, seed: u64) -> Vec<LabeledText> {
    let mut state = seed;
    let mut draw = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    (0..count)
        .map(|_| {
            let words: Vec<String> = (0..2 + draw(6))
                .map(|_| {
                    let word: String = (0..1 + draw(4)).map(|_| (b'a' + draw(3) as u8) as char).collect();
                    if draw(4) == 0 {
                        word.to_uppercase()
                    } else {
                        word
                    }
                })
                .collect();
            let text = words.join(" ");
            let counts = [b'a', b'b', b'c'].map(|l| text.bytes().filter(|c| c.to_ascii_lowercase() == l).count());
            let most = (0..3).fold(0, |best, i| if counts[i] > counts[best] { i } else { best });
            LabeledText { text, pair: None, label: most as i64 }
        })
        .collect()
}

/// Cross-entropy of `[B, classes]` logits against each row's label, smoothed by `epsilon`.
fn smoothed_cross_entropy(epsilon: f64) -> strata::train::LossFn {
    Arc::new(move |logits: &Tensor, batch: &Batch| {
        Ok(logits.f_cross_entropy_loss::<&Tensor>(&batch.targets, None, tch::Reduction::Mean, -100, epsilon)?)
    })
}

/// Upper-case letters folded to lower case: the model reads case-free text.
fn lower_case() -> strata::train::InputFn {
    Arc::new(|batch: &Batch| {
        let ids = &batch.inputs;
        let upper = ids.f_ge(i64::from(b'A'))?.f_logical_and(&ids.f_le(i64::from(b'Z'))?)?;
        Ok(ids.f_where_self(&upper.f_logical_not()?, &ids.f_add_scalar(32)?)?)
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let encode = |records: &[LabeledText], source: &str| {
        ClassifySet::encode(records, &Tokenizer::Bytes, LONGEST as usize, 0, source)
    };
    let data = Data::with_validation(encode(&texts(2000, 1), "letters")?, encode(&texts(128, 2), "letters, held out")?);
    let config = RunConfig {
        steps: 80,
        eval_every: Some(40),
        loss: Some(smoothed_cross_entropy(0.05)),
        prepare_input: Some(lower_case()), // Less device memory than the plain run takes (activations of attention, mostly):
        // the search keeps what fits.
        device_memory: Some(7 << 19),
        strategy: StrategySource::Auto(AutoOptions { dry_run_steps: 2, ..AutoOptions::default() }),
        batching: Batching { batch_size: 32, ctx: LONGEST as usize, ..Batching::default() },
        ..RunConfig::default()
    };
    let mut validation = vec![];
    let mut watch = |r: &StepReport| {
        if let Some(v) = r.val_loss {
            println!("step {}: loss {:.4}, validation {:.4}", r.step, r.loss, v);
            validation.push(v);
        }
        Ok(Flow::Continue)
    };
    let summary = run::train(&Model::from_units(encoder_classifier), &data, &config, &mut [&mut watch])?;
    println!("strategy {}", summary.strategy.to_value());
    // Three classes: a loss of ln 3 = 1.10 knows nothing; learning shows well below it.
    match validation.last() {
        Some(&last) if last < 0.8 => Ok(()),
        last => Err(format!("the validation loss stayed at {last:?}").into()),
    }
}
