//! The step executor of a rank that holds the whole model in one engine (data, ZeRO and
//! tensor parallel alike): micro-batch after micro-batch through the engine.
use super::{evaluate_with, InputFn, LossFn, ModelPart, StepExecutor, StepInput, StepReport};
use crate::checkpoint::Layout;
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::data::Step;
use crate::engine::UnitTime;
use crate::io::WeightsTarget;
use crate::model::ModelSpec;
use crate::{Error, Result};
use std::sync::Arc;
use tch::Tensor;

/// One engine over the whole model. Its losses are this rank's share, averaged over
/// `reported_over` where one is given (a run's ranks, each of which scored its rows).
#[derive(Default)]
pub struct SinglePart {
    reported_over: Option<Arc<dyn ProcessGroup>>,
}

impl SinglePart {
    /// An executor whose losses are averaged over `group` (every rank of a job).
    pub fn reported_over(group: Option<Arc<dyn ProcessGroup>>) -> SinglePart {
        SinglePart { reported_over: group }
    }

    fn agree(&self, loss: f64) -> Result<f64> {
        match &self.reported_over {
            Some(g) => Ok(all_reduce_values(g.as_ref(), &[loss], ReduceOp::Avg)?[0]),
            None => Ok(loss),
        }
    }
}

/// The one part of a single-part trainer.
fn only(parts: &[ModelPart]) -> Result<&ModelPart> {
    match parts {
        [part] => Ok(part),
        _ => Err(Error::Engine(format!("one engine's executor over {} parts", parts.len()))),
    }
}

fn only_mut(parts: &mut [ModelPart]) -> Result<&mut ModelPart> {
    match parts {
        [part] => Ok(part),
        _ => Err(Error::Engine(format!("one engine's executor over {} parts", parts.len()))),
    }
}

impl StepExecutor for SinglePart {
    fn forward_backward(&mut self, parts: &mut [ModelPart], input: StepInput<'_>) -> Result<Vec<Tensor>> {
        let engine = &mut only_mut(parts)?.engine;
        let mut losses = Vec::with_capacity(input.batches.len());
        let last = input.batches.len().saturating_sub(1);
        engine.set_grad_ready(None);
        for (i, batch) in input.batches.iter().enumerate() {
            // Only the last micro-batch's backward completes the step's gradients.
            engine.set_grad_sync(i == last);
            if i == last {
                engine.set_grad_ready(input.grad_ready.clone());
            }
            super::set_rows(engine, batch, Some(input.dropout(batch)));
            let output = engine.forward(&(input.input)(batch)?)?;
            crate::fault::point("backward", input.number)?;
            let loss = super::training_loss(engine, input.loss, &output, batch)?;
            engine.backward(&input.weights.weigh(i, &loss, input.scale)?)?;
            losses.push(loss.f_detach()?);
        }
        engine.set_grad_ready(None);
        // Later forwards of the engine (a caller's own) are not this step's.
        engine.set_dropout(None);
        engine.finish_grads()?;
        Ok(losses)
    }

    fn whole_model_sum(&self, local: f64) -> Result<f64> {
        Ok(local)
    }

    fn grad_norm_is_local(&self, parts: &[ModelPart]) -> bool {
        only(parts).is_ok_and(|p| p.engine.grad_norm_is_local())
    }

    fn updates_in_backward(&self) -> bool {
        true
    }

    fn complete_report(&mut self, _: &[ModelPart], local_loss: Option<f64>, report: &mut StepReport) -> Result<()> {
        let loss = local_loss.ok_or_else(|| Error::Engine("a step of one engine scored no micro-batch".into()))?;
        report.loss = self.agree(loss)?;
        Ok(())
    }

    fn evaluate(&mut self, parts: &mut [ModelPart], steps: &[Step], input: &InputFn, loss: &LossFn) -> Result<f64> {
        // Each rank evaluated its rows of the same batches.
        let mine = evaluate_with(&mut only_mut(parts)?.engine, steps, input, loss)?;
        self.agree(mine)
    }

    fn model_spec<'a>(&'a self, parts: &'a [ModelPart]) -> &'a ModelSpec {
        parts[0].engine.spec()
    }

    fn layout(&self, parts: &[ModelPart]) -> Layout {
        Layout::of(&parts[0].engine)
    }

    fn save_weights(&mut self, parts: &mut [ModelPart], target: WeightsTarget<'_>, write: bool) -> Result<()> {
        crate::io::save_weights(&mut only_mut(parts)?.engine, target, write)
    }

    fn capture_obstacle(&self) -> Option<String> {
        None
    }

    fn scoring_part(&self) -> Option<usize> {
        Some(0)
    }

    fn unit_times(&self, mine: Vec<UnitTime>) -> Result<Vec<UnitTime>> {
        Ok(mine)
    }
}
