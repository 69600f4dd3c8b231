//! The cast of an fp32 master weight to the dtype its products compute in (`amp_native`),
//! as one autograd node that knows the weight's slot in its unit's flat gradient buffer.
//! Where the weight's gradient is fresh (the engine released its `.grad` before the
//! unit's first backward of the step), the node converts the gradient straight into the
//! slot and hands the slot to autograd, which keeps it as the gradient: the engine finds it
//! in place, where a plain cast would have made a new fp32 gradient for the engine to copy
//! into the buffer.
//!
//! `ProductLinear` goes one step further on a GPU (`FusedLinearGrad`): the cast and the
//! linear layer in one node, whose backward writes the weight's gradient in fp32 straight
//! from the product (into the slot where fresh) and the bias's from the same product's
//! epilogue, so no gradient in the products' dtype is written, widened or summed apart.
//!
//! Owns: those nodes. Must not decide when a gradient is fresh, nor where slots are: the
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
        if let Some(slot) = fresh_slot(&self.weight, &mut self.slot) {
            tch::no_grad(|| slot.shallow_clone().f_copy_(g)).map_err(text)?;
            // The only handle left: autograd keeps it rather than copying it.
            return Ok(vec![slot]);
        }
        Ok(vec![g.f_to_kind(self.weight.kind()).map_err(text)?])
    }
}

/// The slot to write `weight`'s gradient into, where the gradient is fresh: a defined
/// `.grad` holds an earlier micro-batch's gradients, which autograd adds a new one to.
fn fresh_slot(weight: &Tensor, slot: &mut Option<Tensor>) -> Option<Tensor> {
    if weight.grad().defined() {
        return None;
    }
    slot.take()
}

pub(crate) struct ProductLinear {
    weight: Tensor,
    kind: Kind,
    slot: Option<Tensor>,
    /// The input's dtype, which its gradient takes.
    input_kind: Kind,
    has_bias: bool,
    /// The input and the weight in `kind`, as the product read them.
    saved: Option<(Tensor, Tensor)>,
}

impl ProductLinear {
    /// `x @ weight.T + bias` computing in `kind`, for fp32 master `weight` (and `bias`).
    pub(crate) fn apply(
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        kind: Kind,
        slot: Option<Tensor>,
    ) -> crate::Result<Tensor> {
        let node = ProductLinear {
            weight: weight.shallow_clone(),
            kind,
            slot,
            input_kind: x.kind(),
            has_bias: bias.is_some(),
            saved: None,
        };
        let mut inputs = vec![x, weight];
        inputs.extend(bias);
        Ok(strata_ext::apply_function(node, &inputs)?.remove(0))
    }
}

impl strata_ext::Function for ProductLinear {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let low = |t: &Tensor| t.f_to_kind(self.kind).map_err(text);
        let (x, w) = (low(&inputs[0])?.f_contiguous().map_err(text)?, low(&inputs[1])?);
        let b = inputs.get(2).map(low).transpose()?;
        let out = x.f_linear(&w, b.as_ref()).map_err(text)?;
        self.saved = Some((x, w));
        Ok(vec![out])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let (x, w) = self.saved.take().ok_or("ProductLinear: backward twice")?;
        let (outs, ins) = (w.size()[0], w.size()[1]);
        let g = grads[0].f_to_kind(self.kind).and_then(|g| g.f_contiguous()).and_then(|g| g.f_reshape([-1, outs]));
        let (g, rows) = (g.map_err(text)?, x.f_reshape([-1, ins]).map_err(text)?);
        let grad_x = g.f_mm(&w).and_then(|t| t.f_reshape(x.size())).and_then(|t| t.f_to_kind(self.input_kind));
        // The slot, where fresh, is returned as the only handle to it (as CastWeight's).
        let dw = match fresh_slot(&self.weight, &mut self.slot) {
            Some(slot) => slot,
            None => self.weight.f_empty_like().map_err(text)?,
        };
        let db = self.has_bias.then(|| Tensor::f_empty([outs], (Kind::Float, g.device()))).transpose().map_err(text)?;
        if !strata_ext::kernels::linear_weight_grad(&g, &rows, &dw, db.as_ref(), false).map_err(text)? {
            // cuBLASLt has no algorithm for the case: the composite's products, widened.
            tch::no_grad(|| -> Result<(), tch::TchError> {
                dw.shallow_clone().f_copy_(&g.f_tr()?.f_mm(&rows)?)?;
                if let Some(db) = &db {
                    db.shallow_clone().f_copy_(&g.f_sum_dim_intlist([0].as_slice(), false, Kind::Float)?)?;
                }
                Ok(())
            })
            .map_err(text)?;
        }
        let mut out = vec![grad_x.map_err(text)?, dw];
        out.extend(db);
        Ok(out)
    }
}
