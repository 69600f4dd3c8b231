//! The cast of an fp32 master weight to the dtype its products compute in (`amp_native`),
//! as one autograd node that knows the weight's slot in its unit's flat gradient buffer.
//! Where the weight's gradient is fresh (the engine released its `.grad` before the
//! unit's first backward of the step), the node converts the gradient straight into the
//! slot and hands the slot to autograd, which keeps it as the gradient: the engine finds it
//! in place, where a plain cast would have made a new fp32 gradient for the engine to copy
//! into the buffer.
//!
//! Owns: that node. Must not decide when a gradient is fresh, nor where slots are: the
//! engine releases and lands `.grad`s and hands the slots to the unit's forward.
use crate::error::text;
use tch::{Kind, Tensor};

pub(crate) struct CastWeight {
    /// The fp32 master weight: its `.grad` tells whether a gradient reached it already.
    weight: Tensor,
    kind: Kind,
    /// The weight's slot in the flat gradient buffer, shaped as the weight; given away once.
    slot: Option<Tensor>,
}

impl CastWeight {
    /// `weight` (a leaf taking a gradient) in `kind`, its gradient converted into `slot`
    /// where fresh.
    pub(crate) fn apply(weight: &Tensor, kind: Kind, slot: Tensor) -> crate::Result<Tensor> {
        let node = CastWeight { weight: weight.shallow_clone(), kind, slot: Some(slot) };
        Ok(strata_ext::apply_function(node, &[weight])?.remove(0))
    }
}

impl strata_ext::Function for CastWeight {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![inputs[0].f_to_kind(self.kind).map_err(text)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let g = &grads[0];
        // A defined `.grad` holds an earlier micro-batch's gradients, which autograd adds
        // the plain cast to.
        if !self.weight.grad().defined() {
            if let Some(slot) = self.slot.take() {
                tch::no_grad(|| slot.shallow_clone().f_copy_(g)).map_err(text)?;
                // The only handle left: autograd keeps it rather than copying it.
                return Ok(vec![slot]);
            }
        }
        Ok(vec![g.f_to_kind(self.weight.kind()).map_err(text)?])
    }
}
