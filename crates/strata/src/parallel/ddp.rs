//! Data parallelism: every rank holds the whole model, trains on its share of the global
//! batch, and gradients are averaged across ranks in buckets: runs of adjacent units of at
//! least the bucket size (25 MiB by default; the first, at the model's end, of at least
//! 1 MiB), each a contiguous slice of the engine's gradient buffer. A bucket's asynchronous
//! all-reduce starts as soon as the backward of its first unit is done (backward runs in
//! reverse), so communication overlaps the backward of the units before it. A parameter no batch reaches simply has a
//! zero gradient, so unused parameters never stall the reduction; unless
//! `find_unused_parameters` says they are expected, a step in which some parameter got no
//! gradient is an error naming them (as PyTorch DDP refuses them). Where an expert group
//! stores its routed experts apart, the stretches of a bucket that hold this rank's experts
//! are averaged over the ranks storing the same experts instead ([`ExpertReplicas`]). Must
//! not touch model definitions or the optimizer: it acts on the engine's buffers only.
use crate::comm::{ProcessGroup, ReduceOp, Work};
use crate::engine::{cut, Engine, HeldStates, Phase, ScheduleContext, UnitSchedule};
use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use strata_ext::Hook;
use tch::Tensor;

/// Bucket size of PyTorch DDP's default, which this follows.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The most the first bucket reduced (the model's last units) waits for, as in PyTorch DDP:
/// a small first all-reduce starts while most of backward is still ahead, where a full-size
/// one would start only once it is nearly over.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Data parallelism as an engine's schedule: each bucket of gradients averaged over the
/// group once backward completes it ([`DataParallel::install`]).
pub struct DataParallel {
    group: Arc<dyn ProcessGroup>,
    /// For each unit that completes a bucket, the bucket (a slice of the gradient buffer)
    /// and where it starts in the buffer.
    bucket_ending_at: Vec<Option<(i64, Tensor)>>,
    experts: Option<ExpertReplicas>,
    /// Where experts are stored apart, the runs of the gradient buffer holding this rank's.
    expert_spans: Vec<(i64, i64)>,
    in_flight: Vec<Work>,
    /// Without `find_unused_parameters`: each trainable parameter's name and whether a
    /// gradient reached it since the last completed step (set by a gradient hook).
    reached: Vec<(String, Arc<AtomicBool>)>,
    _hooks: Vec<Hook>,
}

/// How data parallelism buckets gradients and treats parameters that get none.
#[derive(Clone, Copy, Debug)]
pub struct DataParallelOptions {
    /// Least bytes of gradients in a bucket ([`DEFAULT_BUCKET_BYTES`] by default); the first
    /// bucket's least is at most `FIRST_BUCKET_BYTES`.
    pub bucket_bytes: usize,
    /// Parameters that get no gradient in a step are expected (otherwise an error).
    pub find_unused_parameters: bool,
}

/// Where an expert group stores its routed experts apart: the ranks storing the same experts
/// as this one, whose gradients of them are averaged, and the expert group's size.
#[derive(Clone)]
pub struct ExpertReplicas {
    /// The data-parallel ranks outside this rank's expert group that store its experts
    /// (`None`: no other rank does).
    pub group: Option<Arc<dyn ProcessGroup>>,
    /// Ranks of the expert group.
    pub expert_size: usize,
}

/// Starts averaging `values`, positions `at..` of a buffer whose runs `spans` hold this
/// rank's experts stored apart: the rest over `group`, the experts' runs over
/// `experts.group` after dividing them by the expert group's size, since each expert's
/// gradient sums the tokens of its whole expert group. `experts`: `None` where experts are
/// not stored apart (`spans` then empty).
pub(crate) fn start_average(
    values: &Tensor,
    at: i64,
    spans: &[(i64, i64)],
    group: Option<&Arc<dyn ProcessGroup>>,
    experts: Option<&ExpertReplicas>,
) -> Result<Vec<Work>> {
    let mut started = Vec::new();
    for (start, len, apart) in cut(at, values.numel() as i64, spans) {
        let run = values.f_narrow(0, start - at, len)?;
        let group = match (apart, experts) {
            (false, _) => group,
            (true, Some(experts)) => {
                let _ = run.shallow_clone().f_div_scalar_(experts.expert_size as f64)?;
                experts.group.as_ref()
            }
            (true, None) => return Err(Error::Engine("experts stored apart without their replicas".into())),
        };
        if let Some(g) = group {
            started.push(g.all_reduce(&run, ReduceOp::Avg)?);
        }
    }
    Ok(started)
}

/// Copies `values` (a unit's flat layout, whose runs `spans` hold this rank's experts stored
/// apart) from the first rank of `group`, the experts' runs from the first of
/// `experts.group`: every rank starts from the same model.
pub(crate) fn broadcast_from_first(
    values: &Tensor,
    spans: &[(i64, i64)],
    group: Option<&Arc<dyn ProcessGroup>>,
    experts: Option<&ExpertReplicas>,
) -> Result<()> {
    for (start, len, apart) in cut(0, values.numel() as i64, spans) {
        let group = if apart { experts.and_then(|e| e.group.as_ref()) } else { group };
        if let Some(g) = group {
            g.broadcast(&values.f_narrow(0, start, len)?, 0)?.wait()?;
        }
    }
    Ok(())
}

impl Default for DataParallelOptions {
    fn default() -> Self {
        DataParallelOptions { bucket_bytes: DEFAULT_BUCKET_BYTES, find_unused_parameters: false }
    }
}

impl DataParallel {
    /// Installs data parallelism over `group` on `engine`, after making every rank start
    /// from rank 0's parameters (`sync_module_states`; routed experts stored apart from the
    /// first rank storing them). `experts` is needed exactly where the engine stores its
    /// experts apart.
    pub fn install(
        engine: &mut Engine,
        group: Arc<dyn ProcessGroup>,
        experts: Option<ExpertReplicas>,
        options: DataParallelOptions,
    ) -> Result<()> {
        if options.bucket_bytes == 0 {
            return Err(Error::Config("the bucket size must be positive".into()));
        }
        if experts.is_some() != engine.holding().experts.is_some() {
            return Err(Error::Config(
                "data parallelism reduces experts stored apart over their replicas, and only those".into(),
            ));
        }
        for (k, s) in engine.storage().iter().enumerate() {
            broadcast_from_first(&s.flat, &engine.expert_stretches(k), Some(&group), experts.as_ref())?;
        }
        // Gradients where the group's all-reduces read them in place (shm's shared memory).
        if let Some(grads) = engine.grads() {
            if let Some(shared) = group.alloc(grads.numel() as i64, grads.kind(), grads.device())? {
                engine.place_grads(shared)?;
            }
        }
        let grads = engine
            .grads()
            .ok_or_else(|| Error::Config("data parallelism needs the engine's contiguous gradient layout".into()))?;
        let bucket_ending_at = buckets(engine, FIRST_BUCKET_BYTES.min(options.bucket_bytes), options.bucket_bytes)?
            .into_iter()
            .map(|range| range.map(|(start, len)| Ok((start, grads.f_narrow(0, start, len)?))).transpose())
            .collect::<Result<_>>()?;
        let expert_spans = expert_spans(engine);
        let (mut reached, mut hooks) = (Vec::new(), Vec::new());
        if !options.find_unused_parameters {
            for (name, p) in engine.named_params().filter(|(_, p)| p.requires_grad()) {
                let flag = Arc::new(AtomicBool::new(false));
                let set = flag.clone();
                hooks.push(strata_ext::register_hook(p, move |_| {
                    set.store(true, Ordering::Relaxed);
                    None
                })?);
                reached.push((name.to_string(), flag));
            }
        }
        let in_flight = Vec::new();
        engine.set_schedule(Box::new(DataParallel {
            group,
            bucket_ending_at,
            experts,
            expert_spans,
            in_flight,
            reached,
            _hooks: hooks,
        }));
        Ok(())
    }
}

/// For each unit that closes a bucket, the bucket's (start, length) in the gradient
/// buffer: from the last unit back, runs of units of at least `first_bytes` for the first
/// bucket and `bucket_bytes` for the others.
fn buckets(engine: &Engine, first_bytes: usize, bucket_bytes: usize) -> Result<Vec<Option<(i64, i64)>>> {
    let grads = engine
        .grads()
        .ok_or_else(|| Error::Config("data parallelism needs the engine's contiguous gradient layout".into()))?;
    let esize = grads.kind().elt_size_in_bytes();
    let sizes: Vec<i64> = engine.storage().iter().map(|s| s.grad.numel() as i64).collect();
    let mut out: Vec<Option<(i64, i64)>> = vec![None; sizes.len()];
    let mut end: i64 = sizes.iter().sum();
    let mut start = end;
    let mut cap = first_bytes;
    for k in (0..sizes.len()).rev() {
        start -= sizes[k];
        if (end - start) as usize * esize >= cap || k == 0 {
            out[k] = Some((start, end - start));
            end = start;
            cap = bucket_bytes;
        }
    }
    Ok(out)
}

/// The runs of the engine's gradient buffer that hold this rank's experts stored apart
/// (each unit's gradient span follows the one before).
fn expert_spans(engine: &Engine) -> Vec<(i64, i64)> {
    let mut spans = Vec::new();
    let mut base = 0;
    for (k, s) in engine.storage().iter().enumerate() {
        let len = s.grad.numel() as i64;
        for (start, n) in engine.expert_stretches(k) {
            let (from, to) = ((start - s.grad_start).max(0), (start + n - s.grad_start).min(len));
            if from < to {
                spans.push((base + from, to - from));
            }
        }
        base += len;
    }
    spans
}

impl UnitSchedule for DataParallel {
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> Result<()> {
        if phase == Phase::AfterBackward && ctx.sync_grads {
            if let Some((start, bucket)) = &self.bucket_ending_at[ctx.unit] {
                let experts = self.experts.as_ref();
                let started = start_average(bucket, *start, &self.expert_spans, Some(&self.group), experts)?;
                self.in_flight.extend(started);
            }
        }
        Ok(())
    }

    fn finish_grads(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        for work in self.in_flight.drain(..) {
            work.wait().map_err(|e| Error::Comm(format!("gradient all-reduce failed: {e}")))?;
        }
        if !ctx.sync_grads {
            return Ok(());
        }
        let unused: Vec<&str> =
            self.reached.iter().filter(|(_, r)| !r.swap(false, Ordering::Relaxed)).map(|(n, _)| n.as_str()).collect();
        if !unused.is_empty() {
            return Err(Error::Engine(format!(
                "parameters got no gradient this step: {}; set find_unused_parameters if that is expected",
                unused.join(", ")
            )));
        }
        Ok(())
    }
}

impl HeldStates for DataParallel {
    /// The first rank of the group writes; where experts are stored apart, the first of each
    /// set of ranks storing the same experts.
    fn checkpoint_writer(&self) -> bool {
        match &self.experts {
            Some(ExpertReplicas { group: Some(replicas), .. }) => replicas.rank() == 0,
            Some(ExpertReplicas { group: None, .. }) => true,
            None => self.group.rank() == 0,
        }
    }

    fn capture_obstacle(&self) -> Option<String> {
        (self.group.size() > 1).then(|| super::collectives_obstacle(self.group.size()))
    }

    fn accepts_copied_grads(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::model::{mlp, Builder, MlpConfig};

    #[test]
    fn a_range_is_cut_where_it_enters_and_leaves_each_span() {
        assert_eq!(cut(0, 10, &[]), [(0, 10, false)]);
        let spans = [(0, 4), (6, 2), (11, 5), (30, 1)];
        let runs = [(2, 2, true), (4, 2, false), (6, 2, true), (8, 3, false), (11, 1, true)];
        assert_eq!(cut(2, 10, &spans), runs);
        assert_eq!(cut(6, 2, &spans), [(6, 2, true)]);
    }

    #[test]
    fn buckets_cover_the_gradients_once_from_the_last_unit_back() {
        let mut b = Builder::new();
        mlp(&MlpConfig { vocab: 10, layers: 3, dim: 8 }, &mut b).unwrap();
        let e = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
        let total = e.grads().unwrap().numel();
        // Units: embedding 80, three layers of 72, head 90 elements (f32).
        let per_unit = buckets(&e, 1, 1).unwrap();
        assert!(per_unit.iter().all(Option::is_some), "a tiny bucket size gives one bucket per unit");
        let whole = buckets(&e, usize::MAX, usize::MAX).unwrap();
        assert!(whole[1..].iter().all(Option::is_none));
        assert_eq!(whole[0], Some((0, total as i64)), "a huge size gives one bucket of everything");
        // 150 elements: the head (90) is too small alone, head + last layer (162) is not;
        // the rest (72 + 72 + 80) closes at the first unit.
        let mid = buckets(&e, 150 * 4, 150 * 4).unwrap();
        let sizes = |b: Vec<Option<(i64, i64)>>| b.iter().map(|b| b.map_or(0, |(_, n)| n)).collect::<Vec<_>>();
        assert_eq!(sizes(mid), [224, 0, 0, 162, 0]);
        // A first bucket of 80 elements closes at the head alone; the rest, under the
        // bucket size of everything, closes at the first unit.
        assert_eq!(sizes(buckets(&e, 80 * 4, usize::MAX).unwrap()), [296, 0, 0, 0, 90]);
    }
}
