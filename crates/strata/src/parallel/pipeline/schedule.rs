//! Pipeline schedules as data: each is a pure function from (stages, micro-batches, virtual
//! stages, rank) to the rank's ordered list of operations, and [`simulate`] runs every
//! rank's list against each other with given costs, so orders, deadlocks and bubbles are
//! tested without processes.
//!
//! Rank `r` of `p` holds the virtual stages `chunk·p + r` for `chunk` in `0..v`: stage 0 is
//! rank 0's first chunk, the last stage rank `p − 1`'s last. Activations flow to the next
//! stage and gradients to the previous one; a rank receives each in the order its neighbour
//! sends them, so one ordered queue per direction and neighbour never deadlocks.
use crate::{Error, Result};

pub use crate::strategy::ScheduleKind;

/// One operation of a rank's schedule, on micro-batch `micro` of its chunk `chunk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Receives the chunk's input activation from the previous stage.
    RecvActivation {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
    /// Runs the chunk's forward.
    Forward {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
    /// Sends the chunk's output activation to the next stage.
    SendActivation {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
    /// Receives the gradient of the chunk's output from the next stage.
    RecvGrad {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
    /// Input and weight gradients together.
    Backward {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
    /// The input gradient only; the weight gradient waits for [`Op::BackwardWeight`].
    BackwardInput {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
    /// The weight gradient that [`Op::BackwardInput`] left for later.
    BackwardWeight {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
    /// Sends the gradient of the chunk's input to the previous stage.
    SendGrad {
        /// The micro-batch, counted from 0 within the step.
        micro: usize,
        /// The chunk, counted from 0 among the rank's chunks.
        chunk: usize,
    },
}

impl Op {
    /// The operation's name, its micro-batch and its chunk.
    pub fn parts(self) -> (&'static str, usize, usize) {
        match self {
            Op::RecvActivation { micro, chunk } => ("recv_activation", micro, chunk),
            Op::Forward { micro, chunk } => ("forward", micro, chunk),
            Op::SendActivation { micro, chunk } => ("send_activation", micro, chunk),
            Op::RecvGrad { micro, chunk } => ("recv_grad", micro, chunk),
            Op::Backward { micro, chunk } => ("backward", micro, chunk),
            Op::BackwardInput { micro, chunk } => ("backward_input", micro, chunk),
            Op::BackwardWeight { micro, chunk } => ("backward_weight", micro, chunk),
            Op::SendGrad { micro, chunk } => ("send_grad", micro, chunk),
        }
    }

    /// The operation's place among those a rank of `p` may run (by kind, micro-batch and
    /// chunk), where it is one of them.
    fn slot(self, p: Pipeline) -> Option<usize> {
        let kind = match self {
            Op::RecvActivation { .. } => 0,
            Op::Forward { .. } => 1,
            Op::SendActivation { .. } => 2,
            Op::RecvGrad { .. } => 3,
            Op::Backward { .. } => 4,
            Op::BackwardInput { .. } => 5,
            Op::BackwardWeight { .. } => 6,
            Op::SendGrad { .. } => 7,
        };
        let (_, micro, chunk) = self.parts();
        (micro < p.micro_batches && chunk < p.virtual_stages)
            .then(|| (kind * p.micro_batches + micro) * p.virtual_stages + chunk)
    }
}

/// Kinds of [`Op`].
const OP_KINDS: usize = 8;

/// The shape of a pipeline: `stages` ranks, `micro_batches` per step, `virtual_stages`
/// chunks per rank (1 except for the interleaved schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// Ranks in the pipeline, one stage of each chunk per rank.
    pub stages: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Chunks per rank (1 except for the interleaved schedule).
    pub virtual_stages: usize,
}

/// A compute operation before its communication is added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    F(usize, usize),
    B(usize, usize),
    Bi(usize, usize),
    W(usize, usize),
}

impl Pipeline {
    fn check(&self, kind: ScheduleKind) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("pipeline: {m}")));
        if self.stages == 0 || self.micro_batches == 0 || self.virtual_stages == 0 {
            return bad(format!(
                "stages ({}), micro-batches ({}) and virtual stages ({}) must be positive",
                self.stages, self.micro_batches, self.virtual_stages
            ));
        }
        if self.virtual_stages > 1 && kind != ScheduleKind::Interleaved {
            return bad(format!("{kind:?} runs one chunk per rank, not {}", self.virtual_stages));
        }
        if kind == ScheduleKind::Interleaved && !self.micro_batches.is_multiple_of(self.stages) {
            return bad(format!(
                "the interleaved schedule runs micro-batches in groups of the {} stages; {} is not a multiple",
                self.stages, self.micro_batches
            ));
        }
        Ok(())
    }

    /// Stages of the whole pipeline (chunks of every rank).
    pub fn total_stages(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// The global stage of `rank`'s chunk `chunk`.
    pub fn stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// The bubble fraction the schedule's analysis gives with equal forward, input-gradient
    /// and weight-gradient costs (backward = input + weight gradient).
    pub fn analytic_bubble(&self, kind: ScheduleKind) -> f64 {
        let (p, m, v) = (self.stages as f64, self.micro_batches as f64, self.virtual_stages as f64);
        match kind {
            ScheduleKind::Gpipe | ScheduleKind::OneForwardOneBackward => (p - 1.0) / (m + p - 1.0),
            ScheduleKind::Interleaved => (p - 1.0) / (v * m + p - 1.0),
            // Idle (p − 1)·(F + B − W) of 3m per rank: a third of 1F1B's (p − 1)·3. With equal
            // costs this is also the floor of any schedule: the last stage waits (p − 1)·F
            // for its first input, so ZB-H2's extra micro-batches gain only where W < B.
            ScheduleKind::ZeroBubble | ScheduleKind::ZeroBubbleH2 => (p - 1.0) / (3.0 * m + p - 1.0),
        }
    }
}

/// For every stage of `pipeline` (chunks of every rank, in stage order), the most
/// micro-batches whose activations it keeps at once under `kind`: from a forward until its
/// backward, or, where the backward is split, until its weight gradient (the deferred
/// weight gradients keep their linear layers' inputs; counting the whole micro-batch until
/// then errs on the side of memory).
pub fn most_held(kind: ScheduleKind, pipeline: Pipeline) -> Result<Vec<u64>> {
    let mut most = vec![0u64; pipeline.total_stages()];
    for (rank, ops) in every_rank(kind, pipeline)?.into_iter().enumerate() {
        let mut held = vec![0u64; pipeline.virtual_stages];
        for op in ops {
            match op {
                Op::Forward { chunk, .. } => held[chunk] += 1,
                Op::Backward { chunk, .. } | Op::BackwardWeight { chunk, .. } => {
                    held[chunk] = held[chunk].saturating_sub(1)
                }
                _ => continue,
            }
            for (chunk, &h) in held.iter().enumerate() {
                let stage = pipeline.stage(rank, chunk);
                most[stage] = most[stage].max(h);
            }
        }
    }
    Ok(most)
}

/// Rank `rank`'s operations, in order, for one step of `pipeline` under `kind`.
pub fn schedule(kind: ScheduleKind, pipeline: Pipeline, rank: usize) -> Result<Vec<Op>> {
    pipeline.check(kind)?;
    if rank >= pipeline.stages {
        return Err(Error::Config(format!("pipeline: rank {rank} of {} stages", pipeline.stages)));
    }
    let steps = match kind {
        ScheduleKind::Gpipe => gpipe(pipeline),
        ScheduleKind::OneForwardOneBackward => one_f_one_b(pipeline, rank),
        ScheduleKind::Interleaved => interleaved(pipeline, rank),
        // Built for every rank at once.
        ScheduleKind::ZeroBubble | ScheduleKind::ZeroBubbleH2 => {
            return Ok(every_rank(kind, pipeline)?.swap_remove(rank))
        }
    };
    Ok(with_communication(pipeline, rank, &steps))
}

/// Every rank's operations, in rank order: [`schedule`] of each rank, the zero-bubble
/// schedules (built for all ranks at once) built once.
pub fn every_rank(kind: ScheduleKind, pipeline: Pipeline) -> Result<Vec<Vec<Op>>> {
    let limits = match kind {
        ScheduleKind::ZeroBubble => HeldLimits::H1,
        ScheduleKind::ZeroBubbleH2 => HeldLimits::H2,
        _ => return (0..pipeline.stages).map(|rank| schedule(kind, pipeline, rank)).collect(),
    };
    pipeline.check(kind)?;
    let steps = zero_bubble(pipeline, limits)?;
    Ok(steps.iter().enumerate().map(|(rank, steps)| with_communication(pipeline, rank, steps)).collect())
}

fn gpipe(p: Pipeline) -> Vec<Step> {
    let m = p.micro_batches;
    (0..m).map(|i| Step::F(i, 0)).chain((0..m).map(|i| Step::B(i, 0))).collect()
}

fn one_f_one_b(p: Pipeline, rank: usize) -> Vec<Step> {
    let m = p.micro_batches;
    let warmup = (p.stages - rank - 1).min(m);
    let mut out: Vec<Step> = (0..warmup).map(|i| Step::F(i, 0)).collect();
    for i in 0..m - warmup {
        out.push(Step::F(warmup + i, 0));
        out.push(Step::B(i, 0));
    }
    out.extend((m - warmup..m).map(|i| Step::B(i, 0)));
    out
}

/// Megatron's interleaved order: micro-batches in groups of `p` (whole groups only), each
/// group through every chunk in turn (forward: chunks ascending; backward: descending);
/// warm-up of `2(p − r − 1) + (v − 1)·p` forwards, then one forward and one backward
/// alternately.
fn interleaved(p: Pipeline, rank: usize) -> Vec<Step> {
    let (m, v, stages) = (p.micro_batches, p.virtual_stages, p.stages);
    let order = |backward: bool| -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(m * v);
        for group in (0..m).step_by(stages) {
            let micros = group..(group + stages).min(m);
            for c in 0..v {
                let chunk = if backward { v - 1 - c } else { c };
                out.extend(micros.clone().map(|i| (i, chunk)));
            }
        }
        out
    };
    let (forwards, backwards) = (order(false), order(true));
    let total = m * v;
    let warmup = (2 * (stages - rank - 1) + (v - 1) * stages).min(total);
    let mut out: Vec<Step> = forwards[..warmup].iter().map(|&(i, c)| Step::F(i, c)).collect();
    for k in 0..total - warmup {
        let (i, c) = forwards[warmup + k];
        out.push(Step::F(i, c));
        let (i, c) = backwards[k];
        out.push(Step::B(i, c));
    }
    out.extend(backwards[total - warmup..].iter().map(|&(i, c)| Step::B(i, c)));
    out
}

/// How many micro-batches a zero-bubble schedule lets a stage hold, and how many deferred
/// weight gradients may wait.
#[derive(Clone, Copy)]
enum HeldLimits {
    /// ZB-H1: 1F1B's `p − r` held, `p` waiting.
    H1,
    /// ZB-H2: `2(p − r) − 1` held, `2p` waiting.
    H2,
}

impl HeldLimits {
    fn held(self, stages: usize, rank: usize) -> usize {
        match self {
            HeldLimits::H1 => stages - rank,
            HeldLimits::H2 => 2 * (stages - rank) - 1,
        }
    }

    fn waiting(self, stages: usize) -> usize {
        match self {
            HeldLimits::H1 => stages,
            HeldLimits::H2 => 2 * stages,
        }
    }
}

/// ZB-H1 and ZB-H2, built by running every rank at once with unit costs: a rank computes an
/// input gradient whenever one can start; else a deferred weight gradient if the most that
/// may wait are waiting; else a forward while fewer micro-batches than the stage may hold
/// await their input gradient; else a deferred weight gradient. Weight gradients thus fill
/// the idle slots of 1F1B's warm-up and cool-down; under ZB-H2 extra forwards do too.
fn zero_bubble(p: Pipeline, limits: HeldLimits) -> Result<Vec<Vec<Step>>> {
    let (n, m) = (p.stages, p.micro_batches);
    let mut out: Vec<Vec<Step>> = vec![Vec::new(); n];
    // When each (rank, micro)'s forward output and input gradient are available to others.
    let mut forward_done: Vec<Vec<Option<usize>>> = vec![vec![None; m]; n];
    let mut grad_done: Vec<Vec<Option<usize>>> = vec![vec![None; m]; n];
    let (mut next_f, mut next_b, mut next_w) = (vec![0; n], vec![0; n], vec![0; n]);
    let mut time = 0;
    while (0..n).any(|r| next_w[r] < m) {
        let mut started: Vec<Option<Step>> = vec![None; n];
        for r in 0..n {
            let b = next_b[r];
            let input_grad_ready = b < m
                && forward_done[r][b].is_some_and(|t| t <= time)
                && (r + 1 == n || grad_done[r + 1][b].is_some_and(|t| t <= time));
            let f = next_f[r];
            let forward_ready = f < m
                && f - next_b[r] < limits.held(n, r)
                && (r == 0 || forward_done[r - 1][f].is_some_and(|t| t <= time));
            let waiting = next_b[r] - next_w[r];
            started[r] = if input_grad_ready {
                Some(Step::Bi(b, 0))
            } else if waiting >= limits.waiting(n) {
                Some(Step::W(next_w[r], 0))
            } else if forward_ready {
                Some(Step::F(f, 0))
            } else if next_w[r] < next_b[r] {
                Some(Step::W(next_w[r], 0))
            } else {
                None
            };
        }
        for (r, step) in started.into_iter().enumerate() {
            match step {
                Some(Step::F(i, _)) => {
                    forward_done[r][i] = Some(time + 1);
                    next_f[r] += 1;
                }
                Some(Step::Bi(i, _)) => {
                    grad_done[r][i] = Some(time + 1);
                    next_b[r] += 1;
                }
                Some(Step::W(..)) => next_w[r] += 1,
                _ => continue,
            }
            out[r].push(step.expect("matched above"));
        }
        time += 1;
        if time > 8 * n * m + 8 * n {
            return Err(Error::Engine("pipeline: the zero-bubble schedule did not converge".into()));
        }
    }
    Ok(out)
}

/// The compute steps with the receives before and the sends after them.
fn with_communication(p: Pipeline, rank: usize, steps: &[Step]) -> Vec<Op> {
    let last = p.total_stages() - 1;
    let mut out = Vec::with_capacity(steps.len() * 3);
    for &step in steps {
        match step {
            Step::F(micro, chunk) => {
                let stage = p.stage(rank, chunk);
                if stage > 0 {
                    out.push(Op::RecvActivation { micro, chunk });
                }
                out.push(Op::Forward { micro, chunk });
                if stage < last {
                    out.push(Op::SendActivation { micro, chunk });
                }
            }
            Step::B(micro, chunk) | Step::Bi(micro, chunk) => {
                let stage = p.stage(rank, chunk);
                if stage < last {
                    out.push(Op::RecvGrad { micro, chunk });
                }
                out.push(match step {
                    Step::B(..) => Op::Backward { micro, chunk },
                    _ => Op::BackwardInput { micro, chunk },
                });
                if stage > 0 {
                    out.push(Op::SendGrad { micro, chunk });
                }
            }
            Step::W(micro, chunk) => out.push(Op::BackwardWeight { micro, chunk }),
        }
    }
    out
}

/// Costs of the compute operations in a simulation.
#[derive(Clone, Copy, Debug)]
pub struct Costs {
    /// Time of one chunk's forward of one micro-batch, in the same unit as the others.
    pub forward: f64,
    /// Time of the input gradient's part of a backward.
    pub input_grad: f64,
    /// Time of the weight gradient's part of a backward.
    pub weight_grad: f64,
}

impl Costs {
    /// Forward, input gradient and weight gradient each 1: a whole backward is 2.
    pub const UNIT: Costs = Costs { forward: 1.0, input_grad: 1.0, weight_grad: 1.0 };
}

/// What a simulation found: when each rank finished, and each rank's busy time.
#[derive(Clone, Debug)]
pub struct Simulation {
    /// When each rank finished its last operation.
    pub ends: Vec<f64>,
    /// Each rank's time spent computing.
    pub busy: Vec<f64>,
}

impl Simulation {
    /// Each rank's idle share of the makespan.
    pub fn bubbles(&self) -> Vec<f64> {
        idle_shares(&self.busy, &self.ends)
    }
}

/// Each rank's idle share of a step that began on every rank at once and lasted `spans[r]`
/// on rank `r`, busy `busy[r]`: the step lasts as long as its slowest rank, and a rank done
/// early is idle until then, as it waits for the others in the update.
pub fn idle_shares(busy: &[f64], spans: &[f64]) -> Vec<f64> {
    let step = spans.iter().copied().fold(f64::MIN_POSITIVE, f64::max);
    busy.iter().map(|b| 1.0 - b / step).collect()
}

/// Runs every rank's operations against each other: a receive waits for its send, sends
/// never wait, compute waits for its inputs. Fails on a deadlock, on a receive whose
/// message comes out of order, and on an operation without its prerequisites.
pub fn simulate(pipeline: Pipeline, ranks: &[Vec<Op>], costs: Costs) -> Result<Simulation> {
    use std::collections::VecDeque;
    let p = pipeline;
    let n = ranks.len();
    let last = p.total_stages() - 1;
    let fail = |m: String| Error::Engine(format!("pipeline schedule: {m}"));
    // A rank receives activations from the rank before it in the ring and gradients from
    // the one after it. Ordered queues by receiver and whether they carry gradients
    // (`link`): (micro, chunk of the receiver, time).
    let link = |to: usize, grads: bool| 2 * to + usize::from(grads);
    let sender = |to: usize, grads: bool| if grads { (to + 1) % n } else { (to + n - 1) % n };
    let mut queues: Vec<VecDeque<(usize, usize, f64)>> = vec![VecDeque::new(); 2 * n];
    let (mut clock, mut busy, mut next) = (vec![0.0f64; n], vec![0.0f64; n], vec![0usize; n]);
    // Which of each rank's operations have run, by their slots.
    let mut done = vec![vec![false; OP_KINDS * p.micro_batches * p.virtual_stages]; n];
    // The receiving rank and chunk of stage `s`.
    let at = |s: usize| (s % p.stages, s / p.stages);
    loop {
        let mut progressed = false;
        for r in 0..n {
            while let Some(&op) = ranks[r].get(next[r]) {
                let mut start = clock[r];
                let slot = op.slot(p).ok_or_else(|| fail(format!("rank {r}: {op:?} lies outside {p:?}")))?;
                let need = |o: Op| o.slot(p).is_some_and(|s| done[r][s]);
                let cost = match op {
                    Op::RecvActivation { micro, chunk } | Op::RecvGrad { micro, chunk } => {
                        let grads = matches!(op, Op::RecvGrad { .. });
                        let Some(&(m, c, sent)) = queues[link(r, grads)].front() else { break };
                        if (m, c) != (micro, chunk) {
                            return Err(fail(format!(
                                "rank {r} waits for {op:?} but rank {} sent micro-batch {m} chunk {c} first",
                                sender(r, grads)
                            )));
                        }
                        queues[link(r, grads)].pop_front();
                        start = start.max(sent);
                        0.0
                    }
                    Op::Forward { micro, chunk } => {
                        if p.stage(r, chunk) > 0 && !need(Op::RecvActivation { micro, chunk }) {
                            return Err(fail(format!("rank {r}: {op:?} before its input arrived")));
                        }
                        costs.forward
                    }
                    Op::Backward { micro, chunk } | Op::BackwardInput { micro, chunk } => {
                        let ready = need(Op::Forward { micro, chunk })
                            && (p.stage(r, chunk) == last || need(Op::RecvGrad { micro, chunk }));
                        if !ready {
                            return Err(fail(format!("rank {r}: {op:?} before its forward or gradient")));
                        }
                        match op {
                            Op::Backward { .. } => costs.input_grad + costs.weight_grad,
                            _ => costs.input_grad,
                        }
                    }
                    Op::BackwardWeight { micro, chunk } => {
                        if !need(Op::BackwardInput { micro, chunk }) {
                            return Err(fail(format!("rank {r}: {op:?} before its input gradient")));
                        }
                        costs.weight_grad
                    }
                    Op::SendActivation { micro, chunk } | Op::SendGrad { micro, chunk } => {
                        let grads = matches!(op, Op::SendGrad { .. });
                        let stage = p.stage(r, chunk);
                        let (to, to_chunk) = if grads { at(stage - 1) } else { at(stage + 1) };
                        queues[link(to, grads)].push_back((micro, to_chunk, clock[r]));
                        0.0
                    }
                };
                if std::mem::replace(&mut done[r][slot], true) {
                    return Err(fail(format!("rank {r} runs {op:?} twice")));
                }
                clock[r] = start + cost;
                busy[r] += cost;
                next[r] += 1;
                progressed = true;
            }
        }
        if (0..n).all(|r| next[r] == ranks[r].len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> =
                (0..n).filter_map(|r| ranks[r].get(next[r]).map(|o| format!("rank {r} at {o:?}"))).collect();
            return Err(fail(format!("deadlock: {}", stuck.join(", "))));
        }
    }
    if let Some((l, q)) = queues.iter().enumerate().find(|(_, q)| !q.is_empty()) {
        let (to, grads) = (l / 2, l % 2 == 1);
        return Err(fail(format!("{} messages from rank {} to rank {to} never received", q.len(), sender(to, grads))));
    }
    Ok(Simulation { ends: clock, busy })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [ScheduleKind; 5] = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneForwardOneBackward,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubble,
        ScheduleKind::ZeroBubbleH2,
    ];

    fn all_ranks(kind: ScheduleKind, p: Pipeline) -> Vec<Vec<Op>> {
        let every = every_rank(kind, p).unwrap();
        let one_at_a_time: Vec<Vec<Op>> = (0..p.stages).map(|r| schedule(kind, p, r).unwrap()).collect();
        assert_eq!(every, one_at_a_time, "{kind:?} {p:?}: every rank's schedule at once is each rank's");
        every
    }

    #[test]
    fn every_schedule_runs_each_operation_once_without_deadlock() {
        for kind in KINDS {
            for stages in [2, 4, 8] {
                for micro_batches in 1..=16 {
                    let v = if kind == ScheduleKind::Interleaved { 2 } else { 1 };
                    let p = Pipeline { stages, micro_batches, virtual_stages: v };
                    if kind == ScheduleKind::Interleaved && micro_batches % stages != 0 {
                        let err = schedule(kind, p, 0).unwrap_err().to_string();
                        assert!(err.contains("groups of the"), "{err}");
                        continue;
                    }
                    let ranks = all_ranks(kind, p);
                    let what = format!("{kind:?} p={stages} m={micro_batches}");
                    simulate(p, &ranks, Costs::UNIT).unwrap_or_else(|e| panic!("{what}: {e}"));
                    for (r, ops) in ranks.iter().enumerate() {
                        for micro in 0..micro_batches {
                            for chunk in 0..v {
                                let count = |o: Op| ops.iter().filter(|x| **x == o).count();
                                assert_eq!(count(Op::Forward { micro, chunk }), 1, "{what} rank {r}");
                                let backward = count(Op::Backward { micro, chunk });
                                let split = count(Op::BackwardInput { micro, chunk });
                                assert_eq!(backward + split, 1, "{what} rank {r}: one backward of ({micro}, {chunk})");
                                assert_eq!(count(Op::BackwardWeight { micro, chunk }), split, "{what} rank {r}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn simulated_bubbles_equal_the_analytic_ones() {
        for stages in [2, 4, 8] {
            for micro_batches in 1..=16 {
                for (kind, v) in [
                    (ScheduleKind::Gpipe, 1),
                    (ScheduleKind::OneForwardOneBackward, 1),
                    (ScheduleKind::Interleaved, 2),
                    (ScheduleKind::ZeroBubble, 1),
                    (ScheduleKind::ZeroBubbleH2, 1),
                ] {
                    let p = Pipeline { stages, micro_batches, virtual_stages: v };
                    if kind == ScheduleKind::Interleaved && micro_batches % stages != 0 {
                        continue; // the analysis assumes whole groups of p micro-batches
                    }
                    if kind.splits_backward() && micro_batches < stages {
                        continue; // too few micro-batches to hide the weight gradients
                    }
                    // Chunks of the interleaved schedule cost 1/v each.
                    let scale = 1.0 / v as f64;
                    let costs = Costs { forward: scale, input_grad: scale, weight_grad: scale };
                    let sim = simulate(p, &all_ranks(kind, p), costs).unwrap();
                    let expected = p.analytic_bubble(kind);
                    // Every rank does the same work in the same makespan: each one's bubble
                    // is the analysis', also the ranks that finish before the first.
                    for (rank, got) in sim.bubbles().into_iter().enumerate() {
                        assert!(
                            (got - expected).abs() < 1e-9,
                            "{kind:?} p={stages} m={micro_batches} rank {rank}: simulated {got}, analytic {expected}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_at_most_the_stages_after_it_plus_one() {
        let p = Pipeline { stages: 4, micro_batches: 8, virtual_stages: 1 };
        assert_eq!(most_held(ScheduleKind::OneForwardOneBackward, p).unwrap(), [4, 3, 2, 1]);
        // Split backwards keep a micro-batch until its weight gradient: up to p of those wait.
        assert_eq!(most_held(ScheduleKind::ZeroBubble, p).unwrap(), [7, 6, 5, 4]);
        assert_eq!(most_held(ScheduleKind::ZeroBubbleH2, p).unwrap(), [8, 8, 8, 8]);
        assert_eq!(most_held(ScheduleKind::Gpipe, p).unwrap(), [8, 8, 8, 8]);
        // Fewer micro-batches than stages: no stage holds more than there are.
        let short = Pipeline { micro_batches: 2, ..p };
        assert_eq!(most_held(ScheduleKind::OneForwardOneBackward, short).unwrap(), [2, 2, 2, 1]);
        // Interleaved: one count per chunk, in global stage order.
        let v = Pipeline { stages: 2, micro_batches: 4, virtual_stages: 2 };
        let held = most_held(ScheduleKind::Interleaved, v).unwrap();
        assert_eq!(held.len(), 4);
        assert!(held.iter().all(|&h| (1..=4).contains(&h)), "{held:?}");
    }

    /// The worst rank's bubble of `kind` with `costs`.
    fn worst_bubble(kind: ScheduleKind, p: Pipeline, costs: Costs) -> f64 {
        simulate(p, &all_ranks(kind, p), costs).unwrap().bubbles().into_iter().fold(0.0, f64::max)
    }

    #[test]
    fn zero_bubble_h2_halves_one_f_one_b_where_weight_gradients_are_cheaper() {
        // A weight gradient half an input gradient, as where only a block's linear products
        // are deferred: ZB-H1 keeps (p − 1)(F + B − W) of 1F1B's (p − 1)(F + B + W) idle,
        // more than half; ZB-H2's extra forwards bring it near the floor, the last stage's
        // wait (p − 1)·F for its first input.
        let costs = Costs { forward: 2.0, input_grad: 2.0, weight_grad: 1.0 };
        for stages in [2, 4, 8] {
            for micro_batches in [2 * stages, 4 * stages] {
                let p = Pipeline { stages, micro_batches, virtual_stages: 1 };
                let what = format!("p={stages} m={micro_batches}");
                let one_f_one_b = worst_bubble(ScheduleKind::OneForwardOneBackward, p, costs);
                let h1 = worst_bubble(ScheduleKind::ZeroBubble, p, costs);
                let h2 = worst_bubble(ScheduleKind::ZeroBubbleH2, p, costs);
                assert!(h1 > 0.5 * one_f_one_b, "{what}: ZB-H1 {h1} against 1F1B {one_f_one_b}");
                assert!(h2 <= 0.5 * one_f_one_b, "{what}: ZB-H2 {h2} against 1F1B {one_f_one_b}");
                let wait = (stages - 1) as f64 * costs.forward;
                let floor =
                    wait / (wait + micro_batches as f64 * (costs.forward + costs.input_grad + costs.weight_grad));
                assert!(h2 >= floor - 1e-9, "{what}: ZB-H2 {h2} under the floor {floor}");
            }
        }
    }

    #[test]
    fn bad_pipelines_are_refused() {
        let p = Pipeline { stages: 2, micro_batches: 0, virtual_stages: 1 };
        assert!(schedule(ScheduleKind::Gpipe, p, 0).unwrap_err().to_string().contains("must be positive"));
        let v = Pipeline { stages: 2, micro_batches: 4, virtual_stages: 2 };
        assert!(schedule(ScheduleKind::OneForwardOneBackward, v, 0).is_err());
        assert!(schedule(ScheduleKind::Gpipe, Pipeline { virtual_stages: 1, ..v }, 2).is_err());
    }
}
