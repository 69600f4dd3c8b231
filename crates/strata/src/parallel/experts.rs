//! Expert parallelism's exchange of tokens: a sparse layer's [`ExpertExchange`] over the
//! process group of its rank's expert group. Owns the all-to-all of pieces whose lengths
//! the ranks agreed on beforehand, and the gathers and sums the engine joins experts stored
//! apart with; must not route or compute (the model's sparse layers do).
use crate::comm::{ProcessGroup, ReduceOp};
use crate::model::ExpertExchange;
use crate::{Error, Result};
use std::sync::Arc;
use tch::Tensor;

pub struct ExpertGroup {
    group: Arc<dyn ProcessGroup>,
}

impl ExpertGroup {
    pub fn new(group: Arc<dyn ProcessGroup>) -> ExpertGroup {
        ExpertGroup { group }
    }
}

impl ExpertExchange for ExpertGroup {
    fn size(&self) -> usize {
        self.group.size()
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn all_to_all(&self, inputs: &[Tensor], lengths: &[i64]) -> Result<Vec<Tensor>> {
        let first = inputs.first().ok_or_else(|| Error::Comm("an all-to-all of no pieces".into()))?;
        let width: Vec<i64> = first.size().into_iter().skip(1).collect();
        let outputs = lengths
            .iter()
            .map(|&n| Tensor::f_empty([&[n][..], &width].concat(), (first.kind(), first.device())))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let inputs = inputs.iter().map(Tensor::f_contiguous).collect::<std::result::Result<Vec<_>, _>>()?;
        self.group.all_to_all(&outputs, &inputs)?.wait()?;
        Ok(outputs)
    }

    fn gather(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let x = x.f_contiguous()?;
        let outputs = (0..self.size()).map(|_| x.f_empty_like()).collect::<std::result::Result<Vec<_>, _>>()?;
        self.group.all_gather(&outputs, &x)?.wait()?;
        Ok(outputs)
    }

    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>> {
        crate::comm::all_reduce_values(self.group.as_ref(), values, ReduceOp::Sum)
    }
}
