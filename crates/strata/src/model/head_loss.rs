//! The next-token loss computed inside a decoder's output head, a chunk of positions at a
//! time (the `chunked_loss` method), so that the `[tokens, vocabulary]` logits and their
//! gradient never exist at once: Llama 3's 128k vocabulary at 128k tokens would be 64 GiB
//! of fp32 logits, where a chunk of 1,024 positions takes 0.5 GiB.
//!
//! Owns: the chunked product and cross-entropy, forward and backward (the backward
//! computes each chunk's logits again from the head's input and weight, as Liger's fused
//! linear cross-entropy does). Must not know where its targets come from: the engine hands
//! them to head units through [`crate::model::Params::scoring`].
use super::layers::{is_low, soft_cap, supervised_count, vocab_logits, IGNORE};
use super::{Params, TensorParallel};
use crate::compute::{self, cast};
use crate::{Error, Result};
use tch::{Kind, Tensor};

/// What a head scores its output against in place of returning logits: the rows' next
/// tokens (`[rows, ctx]`, [`IGNORE`] where no loss is taken) and the positions computed at
/// once.
pub struct HeadScoring {
    /// The next token at each position.
    pub targets: Tensor,
    /// Positions whose logits exist at once.
    pub positions: i64,
}

/// A decoder head's output for hidden states `h` (normed, `[rows, ctx, D]`) and the
/// vocabulary weight `w` (`[V, D]`, logits soft-capped at `softcap` where the family says):
/// the logits, or, where `p` carries [`HeadScoring`], the mean next-token loss over the
/// supervised positions, a scalar, computed chunk by chunk.
pub(crate) fn head_output(h: &Tensor, w: &Tensor, vocab: i64, softcap: Option<f64>, p: &Params<'_>) -> Result<Tensor> {
    let Some(scoring) = p.scoring() else { return vocab_logits(h, w, None, vocab, softcap, p.tp()) };
    let d = *h.size().last().unwrap_or(&1);
    // The product's dtype as the plain head's product would take it (autocast's, else the
    // input's): the backward, which runs outside the unit's policy, casts to it again.
    let product = compute::product_kind().or(compute::autocast_kind()).unwrap_or(h.kind());
    let f = ChunkedHeadLoss { positions: scoring.positions.max(1), softcap, product, saved: None };
    let targets = scoring.targets.f_reshape([-1])?.f_to_device(h.device())?;
    Ok(strata_ext::apply_function(f, &[&h.f_reshape([-1, d])?, w, &targets])?.remove(0))
}

/// Cross-entropy of `h · wᵀ` (optionally soft-capped) against targets, chunk by chunk.
struct ChunkedHeadLoss {
    positions: i64,
    softcap: Option<f64>,
    product: Kind,
    saved: Option<Saved>,
}

/// What the backward reads: the inputs, each position's log-partition and the number of
/// supervised positions.
struct Saved {
    h: Tensor,
    w: Tensor,
    targets: Tensor,
    log_partition: Tensor,
    count: Tensor,
}

impl ChunkedHeadLoss {
    /// The logits of positions `start..start + n` in at least fp32 (as the plain loss takes
    /// them), capped where the family caps them.
    fn logits(&self, h: &Tensor, w: &Tensor, start: i64, n: i64) -> Result<Tensor> {
        let x = cast(&h.f_narrow(0, start, n)?, Some(self.product))?;
        let logits = x.f_matmul(&cast(w, Some(self.product))?.f_tr()?)?;
        let logits = match self.softcap {
            Some(cap) => soft_cap(&logits, cap)?,
            None => logits,
        };
        cast(&logits, is_low(logits.kind()).then_some(Kind::Float))
    }

    /// The precision the loss and the weight's gradient are summed in: fp32, or fp64 for a
    /// model computing in fp64.
    fn loss_kind(&self) -> Kind {
        match self.product {
            Kind::Double => Kind::Double,
            _ => Kind::Float,
        }
    }

    /// The chunks' `(start, length)` over `n` positions.
    fn chunks(&self, n: i64) -> impl Iterator<Item = (i64, i64)> + '_ {
        (0..n).step_by(self.positions as usize).map(move |start| (start, self.positions.min(n - start)))
    }

    fn loss(&mut self, h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let n = h.size()[0];
        if targets.size() != [n] {
            return Err(Error::Model(format!("{n} positions scored against {:?} targets", targets.size())));
        }
        let valid = targets.f_ne(IGNORE)?;
        let safe = targets.f_where_scalarother(&valid, 0)?;
        let mut total = Tensor::f_zeros([], (self.loss_kind(), h.device()))?;
        let mut log_partitions = Vec::new();
        for (start, len) in self.chunks(n) {
            let z = self.logits(h, w, start, len)?;
            let log_partition = z.f_logsumexp([-1], false)?;
            let target = z.f_gather(1, &safe.f_narrow(0, start, len)?.f_unsqueeze(1)?, false)?.f_squeeze_dim(1)?;
            let kept = valid.f_narrow(0, start, len)?;
            total = total.f_add(&log_partition.f_sub(&target)?.f_mul(&kept)?.f_sum(self.loss_kind())?)?;
            log_partitions.push(log_partition);
        }
        let count = supervised_count(targets)?;
        let loss = total.f_div(&count)?;
        self.saved = Some(Saved {
            h: h.shallow_clone(),
            w: w.shallow_clone(),
            targets: targets.shallow_clone(),
            log_partition: Tensor::f_cat(&log_partitions, 0)?,
            count,
        });
        Ok(loss)
    }

    /// Gradients of the loss times `g` for `h` and `w`: per chunk, softmax minus the target's
    /// one-hot over the supervised count (times the cap's derivative), then the two products.
    fn grads(&self, saved: &Saved, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let Saved { h, w, targets, log_partition, count } = saved;
        let n = h.size()[0];
        let valid = targets.f_ne(IGNORE)?;
        let safe = targets.f_where_scalarother(&valid, 0)?;
        let weight = valid.f_to_kind(self.loss_kind())?.f_div(count)?.f_mul(&g.f_to_kind(self.loss_kind())?)?;
        let grad_h = Tensor::f_empty(h.size(), (h.kind(), h.device()))?;
        // Summed over chunks in at least fp32, whatever the weight's dtype.
        let mut grad_w = Tensor::f_zeros(w.size(), (self.loss_kind(), w.device()))?;
        let w_product = cast(w, Some(self.product))?;
        for (start, len) in self.chunks(n) {
            // In place where it can be: a chunk holds its logits and one more such tensor.
            let z = self.logits(h, w, start, len)?;
            let mut grad = z.f_sub(&log_partition.f_narrow(0, start, len)?.f_unsqueeze(1)?)?;
            let _ = grad.f_exp_()?;
            let kept = valid.f_narrow(0, start, len)?.f_to_kind(self.loss_kind())?.f_neg()?.f_unsqueeze(1)?;
            let _ = grad.f_scatter_add_(1, &safe.f_narrow(0, start, len)?.f_unsqueeze(1)?, &kept)?;
            let _ = grad.f_mul_(&weight.f_narrow(0, start, len)?.f_unsqueeze(1)?)?;
            if let Some(cap) = self.softcap {
                // d(cap·tanh(x / cap))/dx = 1 − tanh², and tanh = z / cap.
                let mut z = z;
                let _ = z.f_div_scalar_(cap)?.f_square_()?.f_neg_()?.f_add_scalar_(1.0)?;
                let _ = grad.f_mul_(&z)?;
            }
            let grad = grad.f_to_kind(self.product)?;
            let x = cast(&h.f_narrow(0, start, len)?, Some(self.product))?;
            grad_h.f_narrow(0, start, len)?.f_copy_(&grad.f_matmul(&w_product)?)?;
            match self.product == self.loss_kind() {
                true => drop(grad_w.f_addmm_(&grad.f_tr()?, &x)?),
                false => drop(grad_w.f_add_(&grad.f_tr()?.f_matmul(&x)?)?),
            }
        }
        Ok((grad_h, grad_w.f_to_kind(w.kind())?))
    }
}

fn text(e: Error) -> String {
    e.to_string()
}

impl strata_ext::Function for ChunkedHeadLoss {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![self.loss(&inputs[0], &inputs[1], &inputs[2]).map_err(text)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let saved = self.saved.take().ok_or("chunked head loss: backward twice")?;
        let (grad_h, grad_w) = self.grads(&saved, &grads[0]).map_err(text)?;
        Ok(vec![grad_h, grad_w, Tensor::new()])
    }
}

/// Whether a head scores in chunks under `tp` tensor ranks: only unsplit, as the
/// vocabulary-split head's cross-entropy needs its ranks' sums at every chunk.
pub(crate) fn check_tensor_parallel(tp: &dyn TensorParallel) -> Result<()> {
    match tp.size() {
        1 => Ok(()),
        n => Err(Error::Config(format!(
            "chunked_loss: the head's vocabulary is split over {n} tensor ranks; the chunked loss runs on an unsplit head"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks of 3 over 10 positions (the last one short), padding targets among them,
    /// with and without a soft cap: the loss and both gradients are autograd's of the
    /// whole logits' cross-entropy.
    #[test]
    fn the_chunked_loss_is_the_whole_logits_cross_entropy() {
        tch::manual_seed(3);
        let h = Tensor::randn([10, 6], (Kind::Double, tch::Device::Cpu)).set_requires_grad(true);
        let w = Tensor::randn([13, 6], (Kind::Double, tch::Device::Cpu)).set_requires_grad(true);
        let targets = Tensor::from_slice(&[1i64, 12, IGNORE, 4, 4, 0, IGNORE, 7, 9, 2]);
        for softcap in [None, Some(2.5)] {
            let whole = |h: &Tensor, w: &Tensor| {
                let logits = h.matmul(&w.tr());
                let logits = softcap.map_or(logits.shallow_clone(), |cap| soft_cap(&logits, cap).unwrap());
                let sum = logits.cross_entropy_loss::<&Tensor>(&targets, None, tch::Reduction::Sum, IGNORE, 0.0);
                sum / 8.0
            };
            let expected = whole(&h, &w);
            let (eh, ew) = {
                let g = Tensor::run_backward(&[&expected], &[&h, &w], false, false);
                (g[0].shallow_clone(), g[1].shallow_clone())
            };
            let f = ChunkedHeadLoss { positions: 3, softcap, product: Kind::Double, saved: None };
            let got = strata_ext::apply_function(f, &[&h, &w, &targets]).unwrap().remove(0);
            let g = Tensor::run_backward(&[&got], &[&h, &w], false, false);
            let gap = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
            assert!(gap(&got, &expected) < 1e-12, "{softcap:?}: loss off by {}", gap(&got, &expected));
            assert!(gap(&g[0], &eh) < 1e-12 && gap(&g[1], &ew) < 1e-12, "{softcap:?}: gradients differ");
            assert!(ew.abs().max().double_value(&[]) > 1e-3, "the check would pass on zeros");
        }
    }
}
