//! A training step captured as a CUDA graph and replayed ([`Trainer::capture_cuda_graph`]):
//! the copies of the micro-batches and loss weights the graph owns, and the decision of
//! which steps replay it.
use super::{QueuedStep, Trainer};
use crate::data::{Batch, Step};
use crate::{Error, Result};
use tch::Tensor;

/// How a step's micro-batch losses are weighted before backward: by numbers given to the
/// kernels when the step is queued, or by scalars on the device that a captured step reads
/// at each replay.
#[derive(Clone, Copy)]
pub enum LossWeights<'a> {
    /// Weights taken from the step's micro-batches ([`Step::loss_weight`]), times the loss scale.
    Host(&'a Step),
    /// One scalar per micro-batch on the device, refilled before each replay of a captured step.
    Device(&'a [Tensor]),
}

/// What a queued step sends back when it ends: the losses of its micro-batches, then the
/// gradient norm where clipping measured it on the device.
pub(super) enum StepRead {
    Started(crate::compute::ScalarRead),
    /// Stacked on the device, in a step being captured (read after each replay).
    OnDevice(Tensor),
}

impl StepRead {
    pub(super) fn finish(self) -> Result<Vec<f64>> {
        match self {
            StepRead::Started(read) => read.finish(),
            StepRead::OnDevice(values) => Ok(Vec::<f64>::try_from(values.f_to_device(tch::Device::Cpu)?)?),
        }
    }
}

/// `cuda_graph` ([`Trainer::capture_cuda_graph`]): the step captured once the warm-up's
/// eager steps are over.
pub(super) struct GraphedSteps {
    warmup_left: u64,
    device: usize,
    captured: Option<CapturedStep>,
    replays: u64,
}

/// A step captured as a CUDA graph, with its own copies of the micro-batches and of their
/// loss weights, which each replay refills from the step it runs.
struct CapturedStep {
    graph: strata_ext::cuda::Graph,
    batches: Vec<Batch>,
    weights: Vec<Tensor>,
    /// The micro-batches' losses, then the norm where clipping measured one, as f64s.
    read: Tensor,
    norm_on_device: bool,
    /// Device memory the graph's pool holds for its step (activations, casts, scratch).
    pool_bytes: u64,
}

impl CapturedStep {
    /// A copy of `batch` the captured step owns (packed layouts are refused before).
    fn own_batch(batch: &Batch) -> Result<Batch> {
        let own = |t: &Tensor| -> Result<Tensor> {
            let mut copy = t.f_empty_like()?;
            copy.f_copy_(t)?;
            Ok(copy)
        };
        if batch.rollout.is_some() {
            return Err(Error::Config("a captured step cannot take GRPO's completions".into()));
        }
        Ok(Batch {
            inputs: own(&batch.inputs)?,
            targets: own(&batch.targets)?,
            supervised: batch.supervised,
            layout: None,
            padding: batch.padding.as_ref().map(own).transpose()?,
            first_row: batch.first_row,
            reference: batch.reference.as_ref().map(own).transpose()?,
            desirable: batch.desirable.as_ref().map(own).transpose()?,
            margin: batch.margin.as_ref().map(own).transpose()?,
            rollout: None,
        })
    }

    /// Whether `step`'s micro-batches have the captured ones' shapes, dtypes and devices.
    fn fits(&self, step: &Step) -> bool {
        let same = |a: &Tensor, b: &Tensor| a.size() == b.size() && a.kind() == b.kind() && a.device() == b.device();
        self.batches.len() == step.micro_batches.len()
            && self.batches.iter().zip(&step.micro_batches).all(|(a, b)| {
                let same_padding = match (&a.padding, &b.padding) {
                    (Some(a), Some(b)) => same(a, b),
                    (a, b) => a.is_none() && b.is_none(),
                };
                same(&a.inputs, &b.inputs) && same(&a.targets, &b.targets) && same_padding
            })
    }

    /// Refills the captured inputs from `step` and replays the graph.
    fn replay(&self, step: &Step) -> Result<()> {
        for (i, (own, batch)) in self.batches.iter().zip(&step.micro_batches).enumerate() {
            own.inputs.shallow_clone().f_copy_(&batch.inputs)?;
            own.targets.shallow_clone().f_copy_(&batch.targets)?;
            if let (Some(own), Some(padding)) = (&own.padding, &batch.padding) {
                own.shallow_clone().f_copy_(padding)?;
            }
            let _ = self.weights[i].shallow_clone().f_fill_(step.loss_weight(i))?;
        }
        Ok(self.graph.replay()?)
    }
}

impl LossWeights<'_> {
    /// Micro-batch `i`'s `loss`, weighted for backward (and scaled by `scale`, the loss
    /// scale, which a captured step never has).
    pub fn weigh(&self, i: usize, loss: &Tensor, scale: f64) -> Result<Tensor> {
        Ok(match self {
            LossWeights::Host(step) => loss.f_mul_scalar(scale * step.loss_weight(i))?,
            LossWeights::Device(weights) => loss.f_mul(&weights[i].f_to_kind(loss.kind())?)?,
        })
    }
}

impl GraphedSteps {
    /// An eager step ran: one fewer of the warm-up's left.
    pub(super) fn count_eager_step(&mut self) {
        self.warmup_left = self.warmup_left.saturating_sub(1);
    }
}

impl Trainer {
    /// Whether `step` runs through the CUDA graph: graphs are on, the warm-up is over and
    /// the step has the captured shapes (or none is captured yet).
    pub(super) fn graph_due(&self, step: &Step) -> Result<bool> {
        let Some(graphs) = &self.graphs else { return Ok(false) };
        if step.micro_batches.iter().any(|b| b.layout.is_some()) {
            return Err(Error::Config(
                "cuda_graph: packed rows (a row layout) are laid out on the host for each step".into(),
            ));
        }
        Ok(graphs.warmup_left == 0 && graphs.captured.as_ref().is_none_or(|c| c.fits(step)))
    }

    /// `step` through the CUDA graph: captured first if none is, then replayed.
    pub(super) fn replay_step(&mut self, step: &Step) -> Result<QueuedStep> {
        let graphs = self.graphs.as_mut().ok_or_else(|| Error::Engine("no CUDA graph to replay".into()))?;
        let device = graphs.device;
        let captured = match graphs.captured.take() {
            Some(captured) => {
                // The update the host code of a captured step counts once, each replay again.
                self.parts[0].optimizer.count_replayed_step();
                captured
            }
            None => self.capture_step(step, device)?,
        };
        captured.replay(step)?;
        let queued = QueuedStep {
            read: StepRead::Started(crate::compute::ScalarRead::start_stacked(&captured.read, device)?),
            norm_on_device: captured.norm_on_device,
            grad_norm: None,
            skipped: false,
        };
        if let Some(graphs) = self.graphs.as_mut() {
            graphs.captured = Some(captured);
            graphs.replays += 1;
        }
        Ok(queued)
    }

    /// Captures a step shaped as `step` on GPU `device`, over copies of its micro-batches and
    /// loss weights that the graph owns; nothing of it runs until the graph is replayed.
    fn capture_step(&mut self, step: &Step, device: usize) -> Result<CapturedStep> {
        let batches = step.micro_batches.iter().map(CapturedStep::own_batch).collect::<Result<Vec<_>>>()?;
        let weights = (0..batches.len())
            .map(|i| Ok(Tensor::f_full([], step.loss_weight(i), (tch::Kind::Float, tch::Device::Cuda(device)))?))
            .collect::<Result<Vec<_>>>()?;
        let reserved = || strata_ext::cuda::memory_stats(device).map(|s| s.reserved as u64);
        let before = reserved()?;
        let (graph, queued) = strata_ext::cuda::Graph::capture(device, || {
            self.queue_step(&batches, LossWeights::Device(&weights), true)
        })?;
        // A graph's memory comes from segments of its own pool, reserved for it alone.
        let pool_bytes = reserved()?.saturating_sub(before);
        let StepRead::OnDevice(read) = queued.read else {
            return Err(Error::Engine("a captured step must leave its read on the device".into()));
        };
        Ok(CapturedStep { graph, batches, weights, read, norm_on_device: queued.norm_on_device, pool_bytes })
    }

    /// Captures the training step as a CUDA graph after `warmup` eager steps (at least one:
    /// the first steps compile kernels and allocate what every later step reuses), and
    /// replays it for every later step whose micro-batches have the captured shapes: one
    /// launch instead of the host queueing every kernel. A step of other shapes (a shorter
    /// last batch) runs eagerly. Refused, with the reason, where a step needs the host
    /// between its kernels: the executor's (a pipeline's sends and receives), the engine's
    /// (`crate::engine::Engine::capture_obstacle`), a loss scaler's or
    /// `skip_if_nonfinite`'s, which decide on the host whether a step updates.
    pub fn capture_cuda_graph(&mut self, warmup: u64) -> Result<()> {
        let refuse = |why: &str| Err(Error::Config(format!("cuda_graph: {why}")));
        let obstacle = self.executor.capture_obstacle().or_else(|| match &self.parts[..] {
            [part] => part.engine.capture_obstacle(),
            parts => Some(format!("this rank holds {} engines, each a graph of its own", parts.len())),
        });
        if let Some(why) = obstacle {
            return refuse(&why);
        }
        if !self.scaling.updates_unconditionally(None) {
            return refuse("a loss scaler or skip_if_nonfinite decides on the host whether each step updates");
        }
        let tch::Device::Cuda(device) = self.parts[0].engine.config().device else {
            return refuse("it needs a CUDA device");
        };
        self.graphs = Some(GraphedSteps { warmup_left: warmup.max(1), device, captured: None, replays: 0 });
        Ok(())
    }

    /// Steps replayed from a captured CUDA graph so far (the captured step among them).
    pub fn graph_replays(&self) -> u64 {
        self.graphs.as_ref().map_or(0, |g| g.replays)
    }

    /// Device bytes the captured CUDA graph's memory pool holds for the whole run: what its
    /// step needs beyond the model states, which no allocation between replays shows.
    pub fn graph_pool_bytes(&self) -> Option<u64> {
        self.graphs.as_ref()?.captured.as_ref().map(|c| c.pool_bytes)
    }
}
