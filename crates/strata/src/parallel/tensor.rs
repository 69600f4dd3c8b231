//! Tensor parallelism over a process group: the collectives at the edges of split regions
//! as autograd functions, and the vocabulary-parallel cross-entropy (Megatron-LM's
//! `copy_to_tensor_model_parallel_region` and its kin).
//!
//! Owns: [`TensorGroup`], the [`TensorParallel`] the engine hands to units. Must not know
//! which unit calls what: models decide where their regions begin and end.
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::error::text;
use crate::model::TensorParallel;
use crate::{Error, Result};
use std::sync::Arc;
use tch::{Kind, Tensor};

/// The tensor group of one rank, and whether sequence parallel splits activations outside
/// the split regions along the sequence.
pub struct TensorGroup {
    group: Arc<dyn ProcessGroup>,
    sequence_parallel: bool,
}

impl TensorGroup {
    /// This rank's tensor group `group`, with activations split along the sequence outside
    /// the split regions where `sequence_parallel` is set.
    pub fn new(group: Arc<dyn ProcessGroup>, sequence_parallel: bool) -> TensorGroup {
        TensorGroup { group, sequence_parallel }
    }
}

/// Plain collectives on one group, for the forward and backward of the functions below.
/// Errors are strings: they cross libtorch's autograd as exceptions.
struct Collectives(Arc<dyn ProcessGroup>);

impl Collectives {
    fn size(&self) -> i64 {
        self.0.size() as i64
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> std::result::Result<Tensor, String> {
        let out = x.f_contiguous().map_err(text)?.copy();
        self.0.all_reduce(&out, op).and_then(|w| w.wait()).map_err(|e| format!("tensor-parallel all-reduce: {e}"))?;
        Ok(out)
    }

    fn all_gather(&self, x: &Tensor) -> std::result::Result<Vec<Tensor>, String> {
        let x = x.f_contiguous().map_err(text)?;
        let outputs: Vec<Tensor> =
            (0..self.size()).map(|_| x.f_empty_like()).collect::<std::result::Result<_, _>>().map_err(text)?;
        self.0
            .all_gather(&outputs, &x)
            .and_then(|w| w.wait())
            .map_err(|e| format!("tensor-parallel all-gather: {e}"))?;
        Ok(outputs)
    }

    /// `[B, T/tp, ...]` pieces of every rank into `[B, T, ...]`.
    fn gather_sequence(&self, x: &Tensor) -> std::result::Result<Tensor, String> {
        Tensor::f_cat(&self.all_gather(x)?, 1).map_err(text)
    }

    /// The sum over ranks of `[B, T, ...]`, of which this rank keeps `[B, T/tp, ...]`.
    fn scatter_sequence(&self, x: &Tensor) -> std::result::Result<Tensor, String> {
        let t = x.size().get(1).copied().unwrap_or(0);
        if t % self.size() != 0 {
            return Err(format!(
                "sequence parallel splits {t} positions over {} ranks: the length must be a multiple",
                self.size()
            ));
        }
        let inputs: Vec<Tensor> = x
            .f_chunk(self.size(), 1)
            .map_err(text)?
            .iter()
            .map(Tensor::f_contiguous)
            .collect::<std::result::Result<_, _>>()
            .map_err(text)?;
        let output = inputs[0].f_empty_like().map_err(text)?;
        self.0
            .reduce_scatter(&output, &inputs, ReduceOp::Sum)
            .and_then(|w| w.wait())
            .map_err(|e| format!("tensor-parallel reduce-scatter: {e}"))?;
        Ok(output)
    }
}

/// The four edges of a split region: each one's backward is the other's forward.
#[derive(Clone, Copy)]
enum Edge {
    /// Identity forward, all-reduce backward.
    CopyIn,
    /// All-reduce forward, identity backward.
    ReduceOut,
    /// All-gather along the sequence forward, reduce-scatter backward.
    GatherSequence,
    /// Reduce-scatter along the sequence forward, all-gather backward.
    ScatterSequence,
}

struct EdgeFunction {
    edge: Edge,
    comm: Collectives,
}

impl EdgeFunction {
    fn apply(&self, edge: Edge, x: &Tensor) -> std::result::Result<Tensor, String> {
        match edge {
            Edge::CopyIn => Ok(x.shallow_clone()),
            Edge::ReduceOut => self.comm.all_reduce(x, ReduceOp::Sum),
            Edge::GatherSequence => self.comm.gather_sequence(x),
            Edge::ScatterSequence => self.comm.scatter_sequence(x),
        }
    }
}

impl strata_ext::Function for EdgeFunction {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![self.apply(self.edge, &inputs[0])?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let g = &grads[0];
        if !g.defined() {
            return Ok(vec![Tensor::new()]);
        }
        let transpose = match self.edge {
            Edge::CopyIn => Edge::ReduceOut,
            Edge::ReduceOut => Edge::CopyIn,
            Edge::GatherSequence => Edge::ScatterSequence,
            Edge::ScatterSequence => Edge::GatherSequence,
        };
        Ok(vec![self.apply(transpose, g)?])
    }
}

/// Cross-entropy over vocabulary-split logits `[N, V/tp]` (fp32) and targets `[N]`; the
/// backward needs no communication: softmax minus the one-hot target, this rank's columns.
struct VocabCrossEntropy {
    comm: Collectives,
    rank: i64,
    /// Softmax of this rank's columns, the target's column (clamped), whether this rank
    /// holds it, and each row's weight in the mean.
    saved: Option<(Tensor, Tensor, Tensor, Tensor)>,
}

impl VocabCrossEntropy {
    fn loss(&mut self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let columns = logits.size()[1];
        let max = self.comm.all_reduce(&logits.f_amax([-1], true)?, ReduceOp::Max).map_err(Error::Comm)?;
        let shifted = logits.f_sub(&max)?;
        let exp = shifted.f_exp()?;
        let local = targets.f_sub_scalar(self.rank * columns)?;
        let held = local.f_ge(0)?.f_logical_and(&local.f_lt(columns)?)?;
        let column = local.f_clamp(0, columns - 1)?.f_unsqueeze(1)?;
        let target_logit = shifted.f_gather(1, &column, false)?.f_squeeze_dim(1)?.f_mul(&held)?;
        let sums = Tensor::f_stack(&[exp.f_sum_dim_intlist(-1, false, Kind::Float)?, target_logit], 0)?;
        let sums = self.comm.all_reduce(&sums, ReduceOp::Sum).map_err(Error::Comm)?;
        let (exp_sum, target_logit) = (sums.f_get(0)?, sums.f_get(1)?);
        // Ignored targets weigh nothing, as torch's cross_entropy ignores them.
        let valid = targets.f_ne(crate::model::layers::IGNORE)?.f_to_kind(Kind::Float)?;
        let weight = valid.f_div(&crate::model::layers::supervised_count(targets)?)?;
        let loss = exp_sum.f_log()?.f_sub(&target_logit)?.f_mul(&weight)?.f_sum(Kind::Float)?;
        let softmax = exp.f_div(&exp_sum.f_unsqueeze(1)?)?;
        self.saved = Some((softmax, column, held.f_to_kind(Kind::Float)?, weight));
        Ok(loss)
    }
}

impl strata_ext::Function for VocabCrossEntropy {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![self.loss(&inputs[0], &inputs[1]).map_err(text)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let (softmax, column, held, weight) = self.saved.take().ok_or("vocabulary cross-entropy: backward twice")?;
        let grad = || -> Result<Tensor> {
            let minus_one_hot = held.f_neg()?.f_unsqueeze(1)?;
            let grad = softmax.f_scatter_add(1, &column, &minus_one_hot)?;
            Ok(grad.f_mul(&weight.f_unsqueeze(1)?)?.f_mul(&grads[0])?)
        };
        Ok(vec![grad().map_err(text)?, Tensor::new()])
    }
}

/// The vocabulary's columns of every rank side by side; backward, this rank's columns of
/// the gradient (every rank computed the same loss from the same whole logits).
struct WholeVocabulary {
    comm: Collectives,
    rank: i64,
    columns: i64,
}

impl strata_ext::Function for WholeVocabulary {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let shards = self.comm.all_gather(&inputs[0])?;
        Ok(vec![Tensor::f_cat(&shards, -1).map_err(text)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let g = &grads[0];
        if !g.defined() {
            return Ok(vec![Tensor::new()]);
        }
        Ok(vec![g.f_narrow(-1, self.rank * self.columns, self.columns).map_err(text)?.f_contiguous().map_err(text)?])
    }
}

impl TensorGroup {
    fn edge(&self, edge: Edge, x: &Tensor) -> Result<Tensor> {
        let f = EdgeFunction { edge, comm: Collectives(self.group.clone()) };
        Ok(strata_ext::apply_function(f, &[x])?.remove(0))
    }
}

impl TensorParallel for TensorGroup {
    fn size(&self) -> i64 {
        self.group.size() as i64
    }
    fn rank(&self) -> i64 {
        self.group.rank() as i64
    }
    fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }
    fn copy_in(&self, x: &Tensor) -> Result<Tensor> {
        self.edge(Edge::CopyIn, x)
    }
    fn reduce_out(&self, x: &Tensor) -> Result<Tensor> {
        self.edge(Edge::ReduceOut, x)
    }
    fn gather_sequence(&self, x: &Tensor) -> Result<Tensor> {
        self.edge(Edge::GatherSequence, x)
    }
    fn scatter_sequence(&self, x: &Tensor) -> Result<Tensor> {
        self.edge(Edge::ScatterSequence, x)
    }
    fn cross_entropy(&self, local_logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let columns = *local_logits.size().last().unwrap_or(&1);
        let logits = local_logits.f_reshape([-1, columns])?.f_to_kind(Kind::Float)?;
        let f = VocabCrossEntropy { comm: Collectives(self.group.clone()), rank: self.rank(), saved: None };
        Ok(strata_ext::apply_function(f, &[&logits, &targets.f_reshape([-1])?])?.remove(0))
    }
    fn whole_vocabulary(&self, local_logits: &Tensor, vocab: i64) -> Result<Tensor> {
        let columns = *local_logits.size().last().unwrap_or(&1);
        let f = WholeVocabulary { comm: Collectives(self.group.clone()), rank: self.rank(), columns };
        Ok(strata_ext::apply_function(f, &[local_logits])?.remove(0).f_narrow(-1, 0, vocab)?)
    }
    fn gather(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        Collectives(self.group.clone()).all_gather(x).map_err(Error::Comm)
    }
    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>> {
        all_reduce_values(self.group.as_ref(), values, ReduceOp::Sum)
    }
}
