//! Tensor parallelism's pieces on real ranks (processes over shared memory): the edge
//! collectives against their definitions, the vocabulary-parallel cross-entropy against
//! the whole one, the bytes a split model holds, and units that cannot be split.

use crate::common::ranks::{assert_all_ok, connect, run_ranks};
use std::sync::Arc;
use strata::engine::{Category, Engine, EngineConfig, Placement};
use strata::model::layers::{cross_entropy, linear, vocab_logits};
use strata::model::tensor::vocab_rows;
use strata::model::{gpt, Builder, GptConfig, Init, ParamId, Params, TensorParallel, TpRole, Unit};
use strata::parallel::tensor::TensorGroup;
use tch::{Device, Kind, Tensor};

#[test]
fn tensor_parallel_pieces_on_2_ranks() {
    assert_all_ok(&run_ranks(2, "shm", "tensor"));
}

#[test]
fn tensor_parallel_pieces_on_4_ranks() {
    assert_all_ok(&run_ranks(4, "shm", "tensor"));
}

#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    assert_eq!(scenario, "tensor");
    let comm = connect();
    let tp = TensorGroup::new(Arc::from(comm.world().unwrap()), false);
    check_edges(&tp);
    check_cross_entropy(&tp);
    check_split_bytes(Arc::new(TensorGroup::new(Arc::from(comm.world().unwrap()), false)));
    check_unsplittable_unit(Arc::new(tp));
    println!("RANK-OK");
}

/// Values rank `r` contributes: distinct per rank and per element.
fn of_rank(r: i64, shape: &[i64]) -> Tensor {
    let n: i64 = shape.iter().product();
    Tensor::arange(n, (Kind::Double, Device::Cpu)).reshape(shape).f_add_scalar(1000.0 * r as f64).unwrap()
}

fn sum_over_ranks(n: i64, shape: &[i64]) -> Tensor {
    (1..n).fold(of_rank(0, shape), |acc, r| acc + of_rank(r, shape))
}

fn leaf(t: Tensor) -> Tensor {
    t.set_requires_grad(true)
}

fn assert_equal(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    assert!(a.allclose(b, 0.0, 0.0, false), "{what}: {a} against {b}");
}

/// Each edge's forward and backward against what it is defined to compute.
fn check_edges(tp: &TensorGroup) {
    let (n, r) = (tp.size(), tp.rank());
    let whole = [2, 2 * n, 3];
    let piece = [2, 2, 3];

    // Identity forward, gradients summed over the ranks backward.
    let x = leaf(of_rank(r, &piece));
    let y = tp.copy_in(&x).unwrap();
    assert_equal(&y, &of_rank(r, &piece), "copy_in forward");
    strata_ext::backward(&[&y], &[&of_rank(r, &piece)], false).unwrap();
    assert_equal(&x.grad(), &sum_over_ranks(n, &piece), "copy_in backward");

    // Sum forward, identity backward.
    let x = leaf(of_rank(r, &piece));
    let y = tp.reduce_out(&x).unwrap();
    assert_equal(&y, &sum_over_ranks(n, &piece), "reduce_out forward");
    strata_ext::backward(&[&y], &[&of_rank(r, &piece)], false).unwrap();
    assert_equal(&x.grad(), &of_rank(r, &piece), "reduce_out backward");

    // Sequence pieces concatenated forward; the summed gradient's piece backward.
    let x = leaf(of_rank(r, &piece));
    let y = tp.gather_sequence(&x).unwrap();
    let gathered = Tensor::cat(&(0..n).map(|q| of_rank(q, &piece)).collect::<Vec<_>>(), 1);
    assert_equal(&y, &gathered, "gather_sequence forward");
    strata_ext::backward(&[&y], &[&of_rank(r, &whole)], false).unwrap();
    assert_equal(&x.grad(), &sum_over_ranks(n, &whole).narrow(1, 2 * r, 2), "gather_sequence backward");

    // The sum's sequence piece forward; every rank's gradient concatenated backward.
    let x = leaf(of_rank(r, &whole));
    let y = tp.scatter_sequence(&x).unwrap();
    assert_equal(&y, &sum_over_ranks(n, &whole).narrow(1, 2 * r, 2), "scatter_sequence forward");
    strata_ext::backward(&[&y], &[&of_rank(r, &piece)], false).unwrap();
    assert_equal(&x.grad(), &gathered, "scatter_sequence backward");

    let odd = of_rank(r, &[2, 2 * n + 1, 3]);
    let err = tp.scatter_sequence(&odd).unwrap_err().to_string();
    assert!(err.contains("must be a multiple"), "{err}");
}

/// The vocabulary-parallel loss and gradients equal the whole ones, with a vocabulary the
/// ranks do not divide (7 rows): padding rows get no gradient and never win the softmax.
fn check_cross_entropy(tp: &TensorGroup) {
    let (n, r, vocab) = (tp.size(), tp.rank(), 7);
    tch::manual_seed(5);
    let x = Tensor::randn([3, 5, 4], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([vocab, 4], (Kind::Float, Device::Cpu)).f_mul_scalar(2.0).unwrap();
    let targets = Tensor::randint(vocab, [3, 5], (Kind::Int64, Device::Cpu));
    let _ = targets.get(0).get(0).fill_(-100); // ignored, as torch ignores it

    let (x_whole, w_whole) = (leaf(x.copy()), leaf(w.copy()));
    let expected = cross_entropy(&linear(&x_whole, &w_whole, None).unwrap(), &targets).unwrap();
    expected.backward();

    let (x_mine, w_mine) = (leaf(x.copy()), leaf(TpRole::Vocab.shard(&w, n, r).unwrap()));
    let logits = vocab_logits(&x_mine, &w_mine, None, vocab, None, tp).unwrap();
    assert_eq!(logits.size(), [3, 5, vocab_rows(vocab, n)], "whole logits never exist on one rank");
    let loss = tp.cross_entropy(&logits, &targets).unwrap();
    loss.backward();

    let gap =
        |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30);
    assert!(gap(&loss, &expected) < 1e-6, "loss {loss} against {expected}");
    let expected_piece = TpRole::Vocab.shard(&w_whole.grad(), n, r).unwrap();
    assert!(gap(&w_mine.grad(), &expected_piece) < 1e-6, "weight gradient of rank {r}");
    assert!(gap(&x_mine.grad(), &x_whole.grad()) < 1e-6, "input gradient");
    // Rows past the vocabulary are zero in `expected_piece`; they must stay exactly zero.
    let real = (vocab - r * vocab_rows(vocab, n)).clamp(0, vocab_rows(vocab, n));
    let padding = w_mine.grad().narrow(0, real, vocab_rows(vocab, n) - real);
    assert_eq!(padding.abs().sum(Kind::Double).double_value(&[]), 0.0, "padding rows receive no gradient");
    // The masking matters: padding logits of 0 would join the softmax and change the loss.
    let unmasked = tp.cross_entropy(&linear(&x, &w_mine, None).unwrap(), &targets).unwrap();
    assert!(gap(&unmasked, &expected) > 1e-3, "with padding in the softmax the loss differs");
}

/// A tp-split GPT holds exactly the analytic number of parameter elements per rank, in the
/// ledger and in the buffers the allocator gave.
fn check_split_bytes(tp: Arc<dyn TensorParallel>) {
    let n = tp.size();
    let cfg = GptConfig::new(7, 4, 1, 4, 8);
    let (v, t, d) = (cfg.vocab, cfg.ctx, cfg.dim);
    let mut b = Builder::new();
    gpt(&cfg, &mut b).unwrap();
    let engine = Engine::new(b.build().unwrap(), EngineConfig { tensor: Some(tp), ..Default::default() }).unwrap();
    // Whole on every rank: positions, norms, the row layers' biases; split: the rest.
    let whole = t * d + 2 * 2 * d + 2 * d + 2 * d;
    let split = (3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d) / n;
    let elements = vocab_rows(v, n) * d + whole + split;
    let report = engine.ledger().report();
    let params = report[&Placement::Device].by_category[&Category::Params];
    assert_eq!(params, 4 * elements as u64, "ledger bytes of the parameters at tensor size {n}");
    // Parameters and gradients, each one buffer of this rank's pieces.
    assert_eq!(engine.model_state_storage_bytes().unwrap(), 2 * 4 * elements as u64, "allocated bytes");
}

/// A unit that says nothing about tensor parallelism is refused by name.
fn check_unsplittable_unit(tp: Arc<dyn TensorParallel>) {
    struct Scale(ParamId);
    impl Unit for Scale {
        fn kind(&self) -> &'static str {
            "Scale"
        }
        fn forward(&self, p: &Params<'_>, x: &Tensor) -> strata::Result<Tensor> {
            Ok(x.f_mul(&p[self.0])?)
        }
    }
    let mut b = Builder::new();
    let mut u = b.unit("scale");
    let w = u.param("scale.weight", &[4], Init::Ones, TpRole::Replicated);
    u.finish(Scale(w));
    let err = Engine::new(b.build().unwrap(), EngineConfig { tensor: Some(tp), ..Default::default() })
        .err()
        .expect("a unit without a tensor-parallel plan is refused")
        .to_string();
    assert!(err.contains("unit scale: Scale units do not say how they run split"), "{err}");
}
