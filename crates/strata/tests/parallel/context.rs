//! Context parallelism's attention on real ranks (processes over shared memory): each rank's
//! piece of the output and of the queries', keys', values' and sinks' gradients against
//! attention over whole rows in one process, for the ring and the all-to-all, plain causal
//! and with a window, soft-capping, sinks, packed examples and values narrower than keys
//! (the ring's composite blocks), and with the window, sinks and packing alone (its fused
//! blocks in tiles, masked in bands across the window's edge), and with sinks and packing
//! alone (its fused blocks without a mask), and with a window wider than a ring's run;
//! keys and values with fewer heads than the queries (2 and 1 for 4), given unrepeated;
//! in fp64, fp32 and bf16, the ring's keys and values travelling in their own dtype. On a
//! GPU, where there is one, the same with two ranks sharing it: fp32 and bf16 blocks on
//! its fused kernel, fp64 on the composite.

use crate::common::ranks::{assert_all_ok, connect, run_ranks};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use strata::comm::{Collective, CommObserver, Waited};
use strata::model::layers::{attention, examples_differ, AttentionOptions, ScoreTerms};
use strata::model::ContextParallel;
use strata::parallel::context::{piece_of, ContextGroup};
use strata::strategy::ContextKind;
use tch::{Device, Kind, Tensor};

#[test]
fn context_attention_on_2_ranks() {
    assert_all_ok(&run_ranks(2, "shm", "context"));
}

#[test]
fn context_attention_on_4_ranks() {
    assert_all_ok(&run_ranks(4, "shm", "context"));
}

#[test]
fn context_attention_on_2_ranks_of_one_gpu() {
    if !(strata_ext::cuda::is_built() && tch::Cuda::is_available()) {
        eprintln!("context_attention_on_2_ranks_of_one_gpu: skipped, no GPU visible to a build with CUDA");
        return;
    }
    assert_all_ok(&run_ranks(2, "cpu:shm,cuda:shm", "context-gpu"));
}

#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    let device = match scenario.as_str() {
        "context" => Device::Cpu,
        "context-gpu" => Device::Cuda(0),
        other => panic!("scenario {other}"),
    };
    let comm = connect();
    let traffic = Arc::new(Traffic::default());
    comm.observe(Some(traffic.clone()));
    let mut failures = vec![];
    for kind in [ContextKind::Ring, ContextKind::AllToAll] {
        let group = ContextGroup::new(Arc::from(comm.world().unwrap()), kind);
        let (rank, n) = (comm.rank(), comm.size());
        let plain =
            Case { options: AttentionOptions::default(), packed: false, sinks: false, value_width: 8, kv_heads: 2 };
        let everything = Case {
            options: AttentionOptions {
                window: Some(5),
                softcap: Some(2.0),
                scale: Some(0.3),
                bidirectional: false,
                chunk: None,
            },
            packed: true,
            sinks: true,
            value_width: 6,
            kv_heads: 1,
        };
        // Without the cap and with values as wide as keys, the ring's blocks run the fused
        // kernel, masked; the case above takes the composite.
        let uncapped = Case {
            options: AttentionOptions {
                window: Some(5),
                softcap: None,
                scale: Some(0.3),
                bidirectional: false,
                chunk: None,
            },
            packed: true,
            sinks: true,
            value_width: 8,
            kv_heads: 2,
        };
        // Without a window, the ring's fused blocks need no mask for packed rows either.
        let unwindowed = Case {
            options: AttentionOptions {
                window: None,
                softcap: None,
                scale: Some(0.3),
                bidirectional: false,
                chunk: None,
            },
            packed: true,
            sinks: true,
            value_width: 8,
            kv_heads: 2,
        };
        // A window wider than a ring run (8 positions at 2 ranks, 4 at 4), over plain rows:
        // bands whose keys every query sees beside those some do.
        let wide_window = Case {
            options: AttentionOptions {
                window: Some(12),
                softcap: None,
                scale: None,
                bidirectional: false,
                chunk: None,
            },
            packed: false,
            sinks: false,
            value_width: 8,
            kv_heads: 4,
        };
        // Chunks of 6 (Llama 4's chunked attention) cut across ring runs of 8 and 4, over
        // packed rows: the ring masks by places.
        let chunked = Case {
            options: AttentionOptions { chunk: Some(6), scale: Some(0.3), ..AttentionOptions::default() },
            packed: true,
            sinks: false,
            value_width: 8,
            kv_heads: 2,
        };
        let cases = [
            ("plain", plain),
            ("chunks, packed", chunked),
            ("window, cap, sinks, packed", everything),
            ("window, sinks, packed", uncapped),
            ("sinks, packed", unwindowed),
            ("wide window", wide_window),
        ];
        for (name, case) in cases {
            // The same sums in other orders (blocks merged through the log-sum-exp): in
            // fp64 to 1e-12 (the algorithm is exact), in fp32 to 1e-6 of the largest value
            // compared (fp32's rounding, ~6e-8 a sum, over a few dozen terms); in bf16 to
            // 2e-2 (both sides round their inputs' products and their results to 8 bits).
            for (values, bound) in [(Kind::Double, 1e-12), (Kind::Float, 1e-6), (Kind::BFloat16, 2e-2)] {
                let (worst, sent) = case.check(&group, kind, (rank, n), (values, device), &traffic);
                let line = format!(
                    "{kind:?} {values:?} on {device:?} {name}: largest difference {worst:.2e} of the largest value"
                );
                println!("{line}");
                if worst > bound {
                    failures.push(line);
                }
                // The ring's forward passes this rank's keys and values on n − 1 times, in
                // their own dtype.
                let (b, t) = (2, 32 / n as i64);
                let elements = (n as i64 - 1) * b * case.kv_heads * t * (8 + case.value_width);
                let expected = elements as u64 * values.elt_size_in_bytes() as u64;
                if kind == ContextKind::Ring && sent != expected {
                    failures.push(format!("{values:?} {name}: the ring's forward sent {sent} bytes, not {expected}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
    println!("RANK-OK");
}

#[derive(Debug)]
struct Case {
    options: AttentionOptions,
    packed: bool,
    sinks: bool,
    value_width: i64,
    /// Key/value heads, each serving adjacent query heads (4 of them).
    kv_heads: i64,
}

/// The bytes of every all-to-all (the ring's passes among them) this rank has finished.
#[derive(Default)]
struct Traffic(AtomicU64);

impl CommObserver for Traffic {
    fn collective(&self, collective: &Collective) {
        if collective.op == "all_to_all" {
            self.0.fetch_add(collective.bytes, Ordering::SeqCst);
        }
    }

    fn waited(&self, _: &Waited) {}
}

/// A tensor every rank draws alike.
fn drawn(shape: &[i64], seed: i64, (kind, device): (Kind, Device)) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Double, Device::Cpu)).to_kind(kind).to_device(device)
}

impl Case {
    /// The largest absolute difference between this rank's piece of the whole rows'
    /// attention (output and gradients) and what the context group computes, relative to
    /// the largest absolute value of what is compared; and the bytes the context group's
    /// forward sent by all-to-all (`traffic`).
    fn check(
        &self,
        group: &ContextGroup,
        kind: ContextKind,
        (rank, n): (usize, usize),
        values: (Kind, Device),
        traffic: &Traffic,
    ) -> (f64, u64) {
        let (b, h, t, d) = (2, 4, 32, 8);
        let q = drawn(&[b, h, t, d], 1, values);
        let k = drawn(&[b, self.kv_heads, t, d], 2, values);
        let v = drawn(&[b, self.kv_heads, t, self.value_width], 3, values);
        let sinks = drawn(&[h], 4, values);
        let upstream = drawn(&[b, h, t, self.value_width], 5, values);
        // Packed: row 0 holds examples of 7, 12 and 13 positions, row 1 one of 10, one of 3
        // and then 19 positions numbered as the first example (apart from it, yet one
        // example with it; at 2 ranks a run holds both parts), so examples cross the
        // pieces' borders.
        let examples = match self.packed {
            true => {
                let row = |runs: &[(i64, usize)]| -> Vec<i64> {
                    runs.iter().flat_map(|&(example, len)| std::iter::repeat_n(example, len)).collect()
                };
                let rows = [row(&[(0, 7), (1, 12), (2, 13)]), row(&[(0, 10), (1, 3), (0, 19)])];
                Tensor::from_slice(&rows.concat()).view([b, t])
            }
            false => Tensor::zeros([b, t], (Kind::Int64, Device::Cpu)),
        }
        .to_device(values.1);
        let leaves: Vec<Tensor> = [&q, &k, &v, &sinks].iter().map(|x| x.copy().set_requires_grad(true)).collect();
        let hidden = examples_differ(&examples, &examples).unwrap();
        let terms = ScoreTerms { bias: None, sinks: self.sinks.then_some(&leaves[3]) };
        // Whole rows read each key/value head repeated for the query heads it serves; the
        // context group is given them unrepeated.
        let repeated = |x: &Tensor| x.repeat_interleave_self_int(h / self.kv_heads, 1, None);
        let (k_whole, v_whole) = (repeated(&leaves[1]), repeated(&leaves[2]));
        let whole = attention(&leaves[0], &k_whole, &v_whole, &self.options, Some(&hidden), terms, None).unwrap();
        (&whole * &upstream).sum(Kind::Float).backward();
        assert!(whole.abs().sum(Kind::Float).double_value(&[]) > 1.0, "attention computed nothing");

        let piece = piece_of(kind, rank, n);
        let take = |x: &Tensor, dim: i64| piece.take(x, dim).unwrap();
        let mine: Vec<Tensor> = [&q, &k, &v]
            .iter()
            .map(|x| take(x, 2).set_requires_grad(true))
            .chain([sinks.copy().set_requires_grad(true)])
            .collect();
        traffic.0.store(0, Ordering::SeqCst);
        let out = group
            .attention(&mine[0], &mine[1], &mine[2], &self.options, &take(&examples, 1), self.sinks.then_some(&mine[3]))
            .unwrap();
        let sent = traffic.0.load(Ordering::SeqCst);
        (&out * take(&upstream, 2)).sum(Kind::Float).backward();
        let gap = |a: &Tensor, b: &Tensor| {
            let scale = b.abs().max().double_value(&[]).max(1e-30);
            (a - b).abs().max().double_value(&[]) / scale
        };
        let mut worst = gap(&out, &take(&whole, 2));
        for i in 0..3 {
            worst = worst.max(gap(&mine[i].grad(), &take(&leaves[i].grad(), 2)));
        }
        if self.sinks {
            // Each rank's sinks gradient comes from its own queries (ring) or heads
            // (all-to-all): the whole one is their sum.
            let local: Vec<f64> = Vec::try_from(mine[3].grad().to_kind(Kind::Double)).unwrap();
            let summed = group.sum_values(&local).unwrap();
            let summed = Tensor::from_slice(&summed).to_kind(values.0).to_device(values.1);
            worst = worst.max(gap(&summed, &leaves[3].grad()));
        }
        (worst, sent)
    }
}
