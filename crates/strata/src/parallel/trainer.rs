//! The one way a rank's [`Trainer`] is built from a strategy: the mesh decides whether the
//! rank holds the whole model in one engine, or a pipeline's stages (one part per chunk,
//! [`super::pipeline::trainer`]); everything else about the trainer is the same.
use super::{build_engine, mesh_of, DataParallelOptions, RankLayout};
use crate::comm::{Comm, ProcessGroup};
use crate::data::Step;
use crate::engine::EngineConfig;
use crate::model::ModelSpec;
use crate::optim::{GroupRule, LrSchedule, Optimizer, OptimizerConfig};
use crate::strategy::{Dim, Strategy};
use crate::train::{Feed, ModelPart, SinglePart, Trainer};
use crate::Result;
use std::sync::Arc;

/// What building a rank's trainer needs.
pub struct TrainerSetup<'a> {
    /// Makes the whole model's spec (with its adapters and frozen parameters).
    pub spec: &'a dyn Fn() -> Result<ModelSpec>,
    /// How each engine stores and runs the model.
    pub engine: EngineConfig,
    /// The parallel strategy the trainer follows.
    pub strategy: &'a Strategy,
    /// The communicator over the job's ranks; `None` for one process.
    pub comm: Option<&'a Comm>,
    /// Ranks on this host (HYBRID_SHARD's default shard group, pipelines' stages).
    pub local_world_size: usize,
    /// Data parallelism's buckets and unused-parameter policy.
    pub data_parallel: DataParallelOptions,
    /// The optimizer's hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// The optimizer's parameter groups (not under a pipeline).
    pub rules: &'a [GroupRule],
    /// The learning-rate schedule.
    pub schedule: LrSchedule,
    /// The largest total gradient norm a step keeps; larger gradients are scaled down to it
    /// (`None`: no clipping).
    pub grad_clip: Option<f64>,
    /// Micro-batches per step (a pipeline's schedule is laid out for them).
    pub micro_batches: usize,
    /// What the model is fed and scored by.
    pub feed: Feed,
    /// The run's first step, for what is measured before training: the room a step needs
    /// beside model states (offload, a device budget) and a pipeline's unit costs (measured
    /// balance); taken only where something is measured. `None`: nothing is measured.
    pub first_step: Option<&'a dyn Fn() -> Result<&'a Step>>,
    /// The group a one-engine trainer averages its losses over (every rank of a job);
    /// `None`: each rank reports its own share. A pipeline agrees over its own groups.
    pub report_over: Option<Arc<dyn ProcessGroup>>,
}

impl TrainerSetup<'_> {
    /// How this setup's ranks are laid out for an engine (`stage`: a pipeline stage's).
    pub fn rank_layout(&self, stage: bool) -> RankLayout<'_> {
        RankLayout {
            comm: self.comm,
            local_world_size: self.local_world_size,
            data_parallel: self.data_parallel,
            stage,
            optimizer_bytes_per_element: self.optimizer.state_bytes_per_element(),
            non_model: None,
            shard_floor: None,
        }
    }
}

/// This rank's trainer for `setup`: over a pipeline's stages where the strategy's mesh has
/// a pipeline dimension, over one engine otherwise.
pub fn build_trainer(setup: &TrainerSetup<'_>) -> Result<Trainer> {
    let mesh = mesh_of(setup.strategy, setup.comm, setup.local_world_size)?;
    if setup.strategy.chunked_loss().is_some() {
        check_chunked_loss(&(setup.spec)()?, &setup.feed)?;
    }
    if mesh.size(Dim::Pipeline) > 1 {
        return super::pipeline::trainer(setup);
    }
    let mut layout = setup.rank_layout(false);
    let measured = setup.strategy.offload().is_some() || setup.engine.device_budget.is_some();
    if let (Some(first_step), true) = (setup.first_step, measured) {
        // Offload's plan leaves room for what a step holds beside model states (beside a
        // ZeRO stage, for the step itself), measured on a step of the run's own shape; a
        // run that keeps every state on the device is refused if its step cannot fit.
        let first = first_step()?;
        layout = layout.with_room_measured((setup.spec)()?, &setup.engine, setup.strategy, first, &setup.feed)?;
    }
    let mut engine = build_engine((setup.spec)()?, setup.engine.clone(), setup.strategy, &layout)?;
    let optimizer = Optimizer::new(&mut engine, setup.optimizer.clone(), setup.rules)?;
    let part = ModelPart { engine, optimizer, first_unit: 0 };
    let executor = Box::new(SinglePart::reported_over(setup.report_over.clone()));
    let mut trainer = Trainer::over_parts(vec![part], executor, setup.schedule.clone(), setup.grad_clip)?;
    trainer.scaling = setup.strategy.grad_scaling()?;
    trainer.set_feed(&setup.feed);
    Ok(trainer)
}

/// `chunked_loss` scores with the next-token loss in a head that can: a model without such
/// a head, or a loss of the caller's own (which reads logits), is refused.
fn check_chunked_loss(spec: &crate::model::ModelSpec, feed: &crate::train::Feed) -> Result<()> {
    if !spec.scores_in_chunks() {
        return Err(crate::Error::Config(
            "chunked_loss: the model has no output head that computes the next-token loss in chunks (GPT's and the \
             decoder families' do)"
                .into(),
        ));
    }
    if feed.loss.is_some() {
        return Err(crate::Error::Config(
            "chunked_loss: the head computes the next-token loss, and this run scores with a loss of its own".into(),
        ));
    }
    Ok(())
}
