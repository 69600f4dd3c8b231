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
use super::tensor::vocab_rows;
use super::Params;
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
/// supervised positions, a scalar, computed chunk by chunk. Split over a tensor group, each
/// rank scores its columns of the vocabulary and the ranks exchange each position's
/// log-partition and target logit (two numbers a position, once).
pub(crate) fn head_output(h: &Tensor, w: &Tensor, vocab: i64, softcap: Option<f64>, p: &Params<'_>) -> Result<Tensor> {
    let Some(scoring) = p.scoring() else { return vocab_logits(h, w, None, vocab, softcap, p.tp()) };
    let tp = p.tp();
    let h = match tp.size() {
        1 => h.shallow_clone(),
        _ => tp.enter(h)?,
    };
    let d = *h.size().last().unwrap_or(&1);
    // The product's dtype as the plain head's product would take it (autocast's, else the
    // input's): the backward, which runs outside the unit's policy, casts to it again.
    let product = compute::product_kind().or(compute::autocast_kind()).unwrap_or(h.kind());
    let columns = match tp.size() {
        1 => Columns { first: 0, real: w.size()[0] },
        n => {
            let rows = vocab_rows(vocab, n);
            Columns { first: tp.rank() * rows, real: (vocab - tp.rank() * rows).clamp(0, rows) }
        }
    };
    let f = ChunkedHeadLoss {
        positions: scoring.positions.max(1),
        softcap,
        product,
        columns,
        weight_grad: w.requires_grad(),
        saved: None,
    };
    let h = h.f_reshape([-1, d])?;
    let targets = scoring.targets.f_reshape([-1])?.f_to_device(h.device())?;
    let (log_partition, target_logit) = tch::no_grad(|| f.partials(&h, w, &targets))?;
    let (log_partition, target_logit) = match tp.size() {
        1 => (log_partition, target_logit),
        _ => {
            let every = Tensor::f_stack(&tp.gather(&Tensor::f_stack(&[log_partition, target_logit], 0)?)?, 0)?;
            (
                every.f_select(1, 0)?.f_logsumexp([0], false)?,
                every.f_select(1, 1)?.f_sum_dim_intlist(0, false, None::<Kind>)?,
            )
        }
    };
    Ok(strata_ext::apply_function(f, &[&h, w, &targets, &log_partition, &target_logit])?.remove(0))
}

/// The vocabulary's columns a rank's head weight holds: from `first`, its first `real` rows
/// (a split head's last ranks pad theirs past the vocabulary).
#[derive(Clone, Copy)]
struct Columns {
    first: i64,
    real: i64,
}

/// Cross-entropy of `h · wᵀ` (optionally soft-capped) against targets, chunk by chunk, from
/// each position's log-partition and target logit over the whole vocabulary.
struct ChunkedHeadLoss {
    positions: i64,
    softcap: Option<f64>,
    product: Kind,
    columns: Columns,
    /// Whether the head's weight takes a gradient (not where it is frozen).
    weight_grad: bool,
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
    /// The logits over this rank's columns of positions `start..start + n` in at least fp32
    /// (as the plain loss takes them), capped where the family caps them.
    fn logits(&self, h: &Tensor, w: &Tensor, start: i64, n: i64) -> Result<Tensor> {
        let x = cast(&h.f_narrow(0, start, n)?, Some(self.product))?;
        let logits = x.f_matmul(&cast(&self.held(w)?, Some(self.product))?.f_tr()?)?;
        let logits = match self.softcap {
            Some(cap) => soft_cap(&logits, cap)?,
            None => logits,
        };
        cast(&logits, is_low(logits.kind()).then_some(Kind::Float))
    }

    /// The rows of `w` that are vocabulary columns.
    fn held(&self, w: &Tensor) -> Result<Tensor> {
        Ok(w.f_narrow(0, 0, self.columns.real)?)
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

    /// Each target's column among this rank's (0 where it is not one of them), and whether
    /// it is one of them and supervised, as a float mask.
    fn own_targets(&self, targets: &Tensor) -> Result<(Tensor, Tensor)> {
        let local = targets.f_sub_scalar(self.columns.first)?;
        let owned =
            targets.f_ne(IGNORE)?.f_logical_and(&local.f_ge(0)?)?.f_logical_and(&local.f_lt(self.columns.real)?)?;
        Ok((local.f_where_scalarother(&owned, 0)?, owned.f_to_kind(self.loss_kind())?))
    }

    /// Each position's log-partition over this rank's columns and its target's logit where
    /// this rank holds the target (0 elsewhere), `[n]` each, chunk by chunk.
    fn partials(&self, h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = h.size()[0];
        if targets.size() != [n] {
            return Err(Error::Model(format!("{n} positions scored against {:?} targets", targets.size())));
        }
        let (local, owned) = self.own_targets(targets)?;
        let (mut log_partitions, mut picked) = (Vec::new(), Vec::new());
        for (start, len) in self.chunks(n) {
            let z = self.logits(h, w, start, len)?.f_to_kind(self.loss_kind())?;
            log_partitions.push(z.f_logsumexp([-1], false)?);
            let index = local.f_narrow(0, start, len)?.f_unsqueeze(1)?;
            let target = match self.columns.real {
                0 => Tensor::f_zeros([len], (self.loss_kind(), h.device()))?,
                _ => z.f_gather(1, &index, false)?.f_squeeze_dim(1)?,
            };
            picked.push(target.f_mul(&owned.f_narrow(0, start, len)?)?);
        }
        Ok((Tensor::f_cat(&log_partitions, 0)?, Tensor::f_cat(&picked, 0)?))
    }

    /// The mean over supervised positions of the log-partition less the target's logit.
    fn loss(&mut self, inputs: &[Tensor]) -> Result<Tensor> {
        let [h, w, targets, log_partition, target_logit] = inputs else {
            return Err(Error::Model(format!("the chunked head loss takes 5 inputs, not {}", inputs.len())));
        };
        let kept = targets.f_ne(IGNORE)?.f_to_kind(self.loss_kind())?;
        let count = supervised_count(targets)?;
        let total = log_partition.f_sub(target_logit)?.f_mul(&kept)?.f_sum(self.loss_kind())?;
        self.saved = Some(Saved {
            h: h.shallow_clone(),
            w: w.shallow_clone(),
            targets: targets.shallow_clone(),
            log_partition: log_partition.shallow_clone(),
            count: count.shallow_clone(),
        });
        Ok(total.f_div(&count)?)
    }

    /// Gradients of the loss times `g` for `h` (this rank's columns' part of it) and `w`: per
    /// chunk, softmax minus the target's one-hot over the supervised count (times the cap's
    /// derivative), then the two products.
    fn grads(&self, saved: &Saved, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let Saved { h, w, targets, log_partition, count } = saved;
        let n = h.size()[0];
        let valid = targets.f_ne(IGNORE)?;
        let (local, owned) = self.own_targets(targets)?;
        let weight = valid.f_to_kind(self.loss_kind())?.f_div(count)?.f_mul(&g.f_to_kind(self.loss_kind())?)?;
        let grad_h = Tensor::f_empty(h.size(), (h.kind(), h.device()))?;
        // Summed over chunks in at least fp32, whatever the weight's dtype; padding rows keep
        // 0. A frozen head (LoRA's) takes none: it would be a whole [vocabulary, width] more.
        let grad_w_whole =
            self.weight_grad.then(|| Tensor::f_zeros(w.size(), (self.loss_kind(), w.device()))).transpose()?;
        let mut grad_w = grad_w_whole.as_ref().map(|g| self.held(g)).transpose()?;
        let w_product = cast(&self.held(w)?, Some(self.product))?;
        // A rank holding no vocabulary column (a small vocabulary over many tensor ranks)
        // adds nothing to either gradient.
        if self.columns.real == 0 {
            return Ok((
                h.f_zeros_like()?,
                grad_w_whole.map(|g| g.f_to_kind(w.kind())).transpose()?.unwrap_or_else(Tensor::new),
            ));
        }
        for (start, len) in self.chunks(n) {
            // In place where it can be: a chunk holds its logits and one more such tensor.
            let z = self.logits(h, w, start, len)?;
            let mut grad = z.f_sub(&log_partition.f_narrow(0, start, len)?.f_unsqueeze(1)?)?;
            let _ = grad.f_exp_()?;
            let one_hot = owned.f_narrow(0, start, len)?.f_neg()?.f_unsqueeze(1)?.f_to_kind(grad.kind())?;
            let _ = grad.f_scatter_add_(1, &local.f_narrow(0, start, len)?.f_unsqueeze(1)?, &one_hot)?;
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
            match (&mut grad_w, self.product == self.loss_kind()) {
                (None, _) => {}
                (Some(grad_w), true) => drop(grad_w.f_addmm_(&grad.f_tr()?, &x)?),
                (Some(grad_w), false) => drop(grad_w.f_add_(&grad.f_tr()?.f_matmul(&x)?)?),
            }
        }
        Ok((grad_h, grad_w_whole.map(|g| g.f_to_kind(w.kind())).transpose()?.unwrap_or_else(Tensor::new)))
    }
}

fn text(e: Error) -> String {
    e.to_string()
}

impl strata_ext::Function for ChunkedHeadLoss {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![self.loss(inputs).map_err(text)?])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let saved = self.saved.take().ok_or("chunked head loss: backward twice")?;
        let (grad_h, grad_w) = self.grads(&saved, &grads[0]).map_err(text)?;
        Ok(vec![grad_h, grad_w, Tensor::new(), Tensor::new(), Tensor::new()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks of 3 over 10 positions (the last one short), padding targets among them,
    /// with and without a soft cap: the loss and both gradients are autograd's of the
    /// whole logits' cross-entropy, over all the columns and split over two ranks; a rank
    /// past the vocabulary adds nothing.
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
            let gap = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
            let f = chunked(softcap, Columns { first: 0, real: 13 });
            let (log_partition, target) = tch::no_grad(|| f.partials(&h, &w, &targets)).unwrap();
            let got = strata_ext::apply_function(f, &[&h, &w, &targets, &log_partition, &target]).unwrap().remove(0);
            let g = Tensor::run_backward(&[&got], &[&h, &w], false, false);
            assert!(gap(&got, &expected) < 1e-12, "{softcap:?}: loss off by {}", gap(&got, &expected));
            assert!(gap(&g[0], &eh) < 1e-12 && gap(&g[1], &ew) < 1e-12, "{softcap:?}: gradients differ");
            assert!(ew.abs().max().double_value(&[]) > 1e-3, "the check would pass on zeros");
            // Two ranks' columns, 7 each, the second padded with a row past the vocabulary:
            // their partials combined give the whole loss, their input gradients add up to
            // the whole one and their weight gradients are its rows (the padding's zero).
            let pieces: Vec<(ChunkedHeadLoss, Tensor)> = (0..2)
                .map(|r| {
                    let held = w.narrow(0, 7 * r, 7 - r).detach();
                    let piece = Tensor::cat(&[held, Tensor::zeros([r, 6], (Kind::Double, tch::Device::Cpu))], 0);
                    (chunked(softcap, Columns { first: 7 * r, real: 7 - r }), piece.set_requires_grad(true))
                })
                .collect();
            let partials: Vec<(Tensor, Tensor)> =
                pieces.iter().map(|(f, piece)| tch::no_grad(|| f.partials(&h, piece, &targets)).unwrap()).collect();
            let log_partition = Tensor::stack(&[&partials[0].0, &partials[1].0], 0).logsumexp([0], false);
            let target = &partials[0].1 + &partials[1].1;
            let (mut grad_h, mut grad_w) = (h.zeros_like(), vec![]);
            for (f, piece) in pieces {
                let inputs = [&h, &piece, &targets, &log_partition, &target];
                let loss = strata_ext::apply_function(f, &inputs).unwrap().remove(0);
                assert!(gap(&loss, &expected) < 1e-12, "{softcap:?}: a rank's loss off by {}", gap(&loss, &expected));
                let g = Tensor::run_backward(&[&loss], &[&h, &piece], false, false);
                grad_h += &g[0];
                grad_w.push(g[1].shallow_clone());
            }
            assert!(gap(&grad_h, &eh) < 1e-12, "{softcap:?}: the ranks' input gradients do not add up");
            assert!(gap(&Tensor::cat(&grad_w, 0).narrow(0, 0, 13), &ew) < 1e-12, "{softcap:?}: weight gradients");
            assert_eq!(grad_w[1].get(6).abs().max().double_value(&[]), 0.0, "the padding row took a gradient");
            // A third rank past the vocabulary, its rows all padding, adds nothing.
            let mut empty = chunked(softcap, Columns { first: 14, real: 0 });
            let padded = Tensor::zeros([7, 6], (Kind::Double, tch::Device::Cpu));
            let (lp, tl) = empty.partials(&h, &padded, &targets).unwrap();
            assert_eq!((lp.numel(), tl.abs().max().double_value(&[])), (10, 0.0));
            let inputs = [h.shallow_clone(), padded.shallow_clone(), targets.shallow_clone(), log_partition, target];
            drop(empty.loss(&inputs).unwrap());
            let saved = empty.saved.take().unwrap();
            let (nothing_h, nothing_w) = empty.grads(&saved, &Tensor::from(1.0f64)).unwrap();
            assert_eq!((nothing_h.abs().max().double_value(&[]), nothing_w.abs().max().double_value(&[])), (0.0, 0.0));
        }
    }

    /// A frozen head (LoRA's) takes no weight gradient, and the input's is as it was.
    #[test]
    fn a_frozen_head_takes_no_weight_gradient() {
        tch::manual_seed(5);
        let h = Tensor::randn([10, 6], (Kind::Double, tch::Device::Cpu));
        let w = Tensor::randn([13, 6], (Kind::Double, tch::Device::Cpu));
        let targets = Tensor::from_slice(&[1i64, 12, IGNORE, 4, 4, 0, IGNORE, 7, 9, 2]);
        let upstream = Tensor::from(1.0f64);
        let backward = |weight_grad: bool| {
            let mut f = ChunkedHeadLoss { weight_grad, ..chunked(None, Columns { first: 0, real: 13 }) };
            let (log_partition, target) = f.partials(&h, &w, &targets).unwrap();
            let inputs = [h.shallow_clone(), w.shallow_clone(), targets.shallow_clone(), log_partition, target];
            // The loss itself is checked beside the whole logits' above: here, what it keeps.
            drop(f.loss(&inputs).unwrap());
            let saved = f.saved.take().unwrap();
            f.grads(&saved, &upstream).unwrap()
        };
        let (trained_h, trained_w) = backward(true);
        let (frozen_h, frozen_w) = backward(false);
        assert!(trained_w.defined() && !frozen_w.defined(), "a frozen head took a weight gradient");
        assert!(frozen_h.equal(&trained_h) && trained_h.abs().max().double_value(&[]) > 1e-3);
    }

    fn chunked(softcap: Option<f64>, columns: Columns) -> ChunkedHeadLoss {
        ChunkedHeadLoss { positions: 3, softcap, product: Kind::Double, columns, weight_grad: true, saved: None }
    }
}
