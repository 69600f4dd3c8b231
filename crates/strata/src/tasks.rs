//! A record task's scores on held-out records, as a user of the task reads them: a
//! classifier's loss, accuracy and macro-F1; an encoder–decoder's loss and the ROUGE-L of
//! its greedy generations against the references; a masked language model's loss on the
//! tokens it predicts.
//!
//! Owns batching the records for scoring and the scores' arithmetic over them. Must not
//! train or place weights: it runs forwards and generation on the engine it is lent.
use crate::data::{
    predictions, rouge_l, scores, Batch, ClassifySet, MaskedSet, RowSet, Scores, Seq2SeqSet, Step, Tokenizer,
};
use crate::engine::Engine;
use crate::generate::{generate_from_source, GenerateConfig};
use crate::{Error, Result};

/// A classifier's scores on labeled texts.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct ClassifyReport {
    /// Mean cross-entropy per text.
    pub loss: f64,
    /// The fraction of texts whose predicted label is the true one.
    pub accuracy: f64,
    /// The mean of each class's F1 over the classes that occur or are predicted.
    pub macro_f1: f64,
    /// Texts scored.
    pub texts: usize,
}

/// An encoder–decoder's scores on sources with their targets.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Seq2SeqReport {
    /// Mean cross-entropy per target token, the decoder reading the reference (teacher forcing).
    pub loss: f64,
    /// Mean ROUGE-L (F-measure) of the generated targets against the references.
    pub rouge_l: f64,
    /// Records scored.
    pub records: usize,
}

/// A masked language model's scores on masked text.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct MaskedLmReport {
    /// Mean cross-entropy per masked token.
    pub loss: f64,
    /// Masked tokens scored (those that take a loss).
    pub masked_tokens: u64,
}

/// How much of a set is scored: `rows` records a batch, the first `batches` batches (all,
/// the last one partial, where `None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scoring {
    /// Records per batch.
    pub rows: usize,
    /// Batches scored from the start of the set (`None`: all).
    pub batches: Option<usize>,
}

/// The records of `set` in batches as `scoring` says, on `device`, each a step of its own.
fn steps(set: &dyn RowSet, scoring: Scoring, device: tch::Device) -> Result<Vec<Step>> {
    if scoring.rows == 0 || scoring.batches == Some(0) {
        return Err(Error::Config("scoring needs at least one row and one batch".into()));
    }
    let all: Vec<usize> = (0..set.len()).collect();
    all.chunks(scoring.rows)
        .take(scoring.batches.unwrap_or(usize::MAX))
        .enumerate()
        .map(|(i, chunk)| Ok(Step::new(i, vec![set.batch(chunk)?.to_device(device)?])))
        .collect()
}

/// `engine`'s loss, accuracy and macro-F1 on the texts of `set` that `scoring` takes.
pub fn classify(engine: &mut Engine, set: &ClassifySet, scoring: Scoring, classes: usize) -> Result<ClassifyReport> {
    let steps = steps(set, scoring, engine.config().device)?;
    let mut predicted = Vec::with_capacity(set.len());
    let mut losses = Vec::with_capacity(steps.len());
    for batch in steps.iter().flat_map(|s| &s.micro_batches) {
        let (logits, loss) = forward(engine, batch)?;
        predicted.extend(predictions(&logits)?);
        losses.push(loss);
    }
    let truth = &set.labels()[..predicted.len()];
    let Scores { accuracy, macro_f1 } = scores(&predicted, truth, classes);
    Ok(ClassifyReport { loss: crate::train::token_mean(&steps, &losses)?, accuracy, macro_f1, texts: predicted.len() })
}

/// `engine`'s loss on the records of `set` that `scoring` takes and the mean ROUGE-L of the
/// targets it writes for their sources under `generation` (greedy unless it samples),
/// decoded by `tokenizer` without special tokens, against each record's target text as
/// read (its ids decoded, for a set made from ids).
pub fn seq2seq(
    engine: &mut Engine,
    set: &Seq2SeqSet,
    scoring: Scoring,
    tokenizer: &Tokenizer,
    generation: &GenerateConfig,
) -> Result<Seq2SeqReport> {
    let steps = steps(set, scoring, engine.config().device)?;
    let records = steps.iter().flat_map(|s| &s.micro_batches).map(|b| b.inputs.size()[0] as usize).sum();
    let losses = steps
        .iter()
        .flat_map(|s| &s.micro_batches)
        .map(|batch| forward(engine, batch).map(|(_, loss)| loss))
        .collect::<Result<Vec<_>>>()?;
    let loss = crate::train::token_mean(&steps, &losses)?;
    let text = |ids: &[i64]| -> Result<String> {
        let kept: Vec<u32> = ids
            .iter()
            .filter(|t| !generation.stop_tokens.contains(t))
            .map(|&t| u32::try_from(t).map_err(|_| Error::Data(format!("token {t} is no id"))))
            .collect::<Result<_>>()?;
        tokenizer.decode_text(&kept)
    };
    let mut total = 0.0;
    for r in 0..records {
        let source: Vec<i64> = set.source_ids(r).iter().map(|&t| i64::from(t)).collect();
        let written = generate_from_source(engine, &source, set.decoder_start(), generation)?;
        let reference = match set.reference(r) {
            Some(read) => read.to_string(),
            None => text(&set.target_ids(r).iter().map(|&t| i64::from(t)).collect::<Vec<_>>())?,
        };
        total += rouge_l(&text(&written)?, &reference);
    }
    Ok(Seq2SeqReport { loss, rouge_l: total / records.max(1) as f64, records })
}

/// `engine`'s loss on the masked tokens of the rows of `set` that `scoring` takes.
pub fn masked_lm(engine: &mut Engine, set: &MaskedSet, scoring: Scoring) -> Result<MaskedLmReport> {
    let steps = steps(set, scoring, engine.config().device)?;
    let losses = steps
        .iter()
        .flat_map(|s| &s.micro_batches)
        .map(|batch| forward(engine, batch).map(|(_, loss)| loss))
        .collect::<Result<Vec<_>>>()?;
    let masked_tokens = steps.iter().map(|s| s.global_supervised).sum();
    Ok(MaskedLmReport { loss: crate::train::token_mean(&steps, &losses)?, masked_tokens })
}

/// The batch's output and its mean loss, forward only.
fn forward(engine: &mut Engine, batch: &Batch) -> Result<(tch::Tensor, f64)> {
    engine.set_layout(batch.layout.as_ref());
    let out = engine.evaluate(&batch.inputs);
    // The layout is this batch's alone, whatever the forward did.
    engine.set_layout(None);
    let out = out?;
    let loss = engine.compute_loss(|| crate::model::layers::cross_entropy(&out, &batch.targets))?;
    Ok((out, loss.f_double_value(&[])?))
}
