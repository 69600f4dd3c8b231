//! Multi-process tests of the collectives. The driver tests host a store and start several
//! copies of this test binary, each running `rank_entry` as one rank (this machine has two
//! cores; four ranks oversubscribe it on purpose).
use crate::common;

use crate::common::ranks::{assert_all_ok, connect, run_ranks, run_ranks_with};
#[cfg(feature = "mpi")]
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use strata::comm::{Collective, Comm, CommObserver, ProcessGroup, ReduceOp, Store, StoreServer, Waited};
use tch::{Device, Kind, Tensor};

const KINDS: [Kind; 6] = [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16, Kind::Int, Kind::Int64];
const SIZES: [i64; 5] = [0, 1, 7, 1031, 300_000];

#[test]
fn collectives_on_shm_with_2_ranks() {
    assert_all_ok(&run_ranks(2, "shm", "collectives"));
}

/// The arena collectives with rank 1's slots written by streaming stores at every size
/// and rank 0's by the stores it measures (cached below 4 MiB).
#[test]
fn collectives_on_shm_with_streaming_slot_stores_on_one_rank() {
    let vars = |rank| if rank == 1 { vec![("STRATA_SHM_SLOT_STORES", "streaming")] } else { vec![] };
    assert_all_ok(&run_ranks_with(2, "shm", "collectives", vars));
}

#[test]
fn a_bad_slot_store_setting_fails_the_group_in_one_line() {
    for o in run_ranks_with(2, "shm", "collectives", |_| vec![("STRATA_SHM_SLOT_STORES", "nt")]) {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{err}");
        // The rank's panic prints the error quoted, its quotes escaped.
        assert!(err.contains(r#"STRATA_SHM_SLOT_STORES=\"nt\" is not one of auto, cached, streaming"#), "{err}");
    }
}

#[test]
fn collectives_on_shm_with_4_ranks() {
    assert_all_ok(&run_ranks(4, "shm", "collectives"));
}

/// The mpi backend under a real `mpirun` (Open MPI), which starts the ranks itself.
#[cfg(feature = "mpi")]
fn run_mpi(n: usize) {
    let token = "test-token";
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), token).unwrap();
    let vars = [
        ("STRATA_TEST_SCENARIO", "collectives".to_string()),
        ("STRATA_TEST_BACKEND", "mpi".into()),
        ("STRATA_TEST_STORE", server.addr().to_string()),
        ("STRATA_TEST_TOKEN", token.into()),
        ("STRATA_STORE_TOKEN", token.into()),
    ];
    let mut mpirun = Command::new("mpirun");
    mpirun.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()]);
    for (k, v) in &vars {
        mpirun.env(k, v).args(["-x", k]);
    }
    let out = mpirun
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "comm::rank_entry", "--nocapture", "--test-threads", "1"])
        .output()
        .expect("mpirun runs (install Open MPI)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.matches("RANK-OK").count() == n,
        "mpirun failed ({:?}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(feature = "mpi")]
#[test]
fn collectives_on_mpi_with_2_and_4_ranks() {
    run_mpi(2);
    run_mpi(4);
}

#[test]
fn collectives_on_tcp_with_2_ranks() {
    assert_all_ok(&run_ranks(2, "tcp", "collectives"));
}

#[test]
fn collectives_on_tcp_with_4_ranks() {
    assert_all_ok(&run_ranks(4, "tcp", "collectives"));
}

/// Rank 1 is killed with SIGKILL in the middle of a large all-reduce; the others must fail
/// within the timeout with an error naming rank 1, not hang or return a wrong result.
fn killed_peer(backend: &str) {
    let start = Instant::now();
    let outputs = run_ranks(3, backend, "killed-peer");
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(outputs[1].status.signal(), Some(libc::SIGKILL), "rank 1 should die by SIGKILL");
    for rank in [0, 2] {
        let out = String::from_utf8_lossy(&outputs[rank].stdout);
        assert!(
            outputs[rank].status.success() && out.contains("FAILED-CLEANLY"),
            "rank {rank}:\n{out}\n{}",
            String::from_utf8_lossy(&outputs[rank].stderr)
        );
        assert!(out.contains("rank 1"), "rank {rank}'s error must name rank 1:\n{out}");
    }
}

#[test]
fn a_killed_rank_fails_the_others_on_shm() {
    killed_peer("shm");
}

#[test]
fn a_killed_rank_fails_the_others_on_tcp() {
    killed_peer("tcp");
}

// ---- the rank side -----------------------------------------------------------------------

fn values(kind: Kind, numel: i64, offset: i64) -> Tensor {
    // Small integers: exact in every dtype, even bf16, after summing four ranks.
    (Tensor::arange(numel, (Kind::Int64, Device::Cpu)).remainder(16) + offset).to_kind(kind)
}

/// `offset`, `offset + 1`, … in f32 (exact below 2^24): no two pieces of a chunked copy
/// hold the same bytes, so a piece read from the wrong place or at the wrong time shows.
fn distinct(numel: i64, offset: i64) -> Tensor {
    Tensor::arange(numel, (Kind::Float, Device::Cpu)) + offset as f64
}

fn same(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    assert!(a.to_kind(Kind::Double).equal(&b.to_kind(Kind::Double)), "{what}: {a:?} vs {b:?}");
}

fn check_collectives(g: &dyn ProcessGroup) {
    let (r, n) = (g.rank() as i64, g.size() as i64);
    let ranks_sum = n * (n - 1) / 2;
    for kind in KINDS {
        for numel in SIZES {
            let what = |op: &str| format!("{op} {kind:?} x{numel} on {}", g.backend());
            let t = values(kind, numel, r);
            g.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
            same(&t, &(values(kind, numel, 0) * n + ranks_sum).to_kind(kind), &what("all_reduce sum"));
            let t = values(kind, numel, r);
            g.all_reduce(&t, ReduceOp::Max).unwrap().wait().unwrap();
            same(&t, &values(kind, numel, n - 1), &what("all_reduce max"));
            let t = values(kind, numel, r);
            g.all_reduce(&t, ReduceOp::Min).unwrap().wait().unwrap();
            same(&t, &values(kind, numel, 0), &what("all_reduce min"));
            if matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) {
                let t = values(kind, numel, 2 * r);
                g.all_reduce(&t, ReduceOp::Avg).unwrap().wait().unwrap();
                same(&t, &values(kind, numel, n - 1), &what("all_reduce avg"));
            } else {
                assert!(g.all_reduce(&values(kind, 1, 0), ReduceOp::Avg).is_err(), "avg of integers is refused");
            }
            // Broadcast from the last rank (sizes above the pipeline's chunk included).
            let t = if r == n - 1 { values(kind, numel, 3) } else { Tensor::zeros([numel], (kind, Device::Cpu)) };
            g.broadcast(&t, (n - 1) as usize).unwrap().wait().unwrap();
            same(&t, &values(kind, numel, 3), &what("broadcast"));
            // Reduce to rank 1: the root gets the sum, the others keep their tensor.
            let t = values(kind, numel, r);
            g.reduce(&t, 1, ReduceOp::Sum).unwrap().wait().unwrap();
            let expected =
                if r == 1 { (values(kind, numel, 0) * n + ranks_sum).to_kind(kind) } else { values(kind, numel, r) };
            same(&t, &expected, &what("reduce"));
        }
        // Uneven all-gather: rank i contributes i elements (rank 0 none).
        let outputs: Vec<Tensor> = (0..n).map(|i| Tensor::zeros([i], (kind, Device::Cpu))).collect();
        g.all_gather(&outputs, &values(kind, r, r)).unwrap().wait().unwrap();
        for (i, o) in outputs.iter().enumerate() {
            same(o, &values(kind, i as i64, i as i64), &format!("all_gather {kind:?} from {i}"));
        }
        // In place, in pieces larger than one chunk of the shared arena: the inputs are views
        // of one flat buffer, each rank's input is its own output.
        let m = 300_001;
        let flat = Tensor::zeros([m * n], (kind, Device::Cpu));
        let outputs: Vec<Tensor> = (0..n).map(|i| flat.narrow(0, i * m, m)).collect();
        outputs[r as usize].shallow_clone().copy_(&values(kind, m, r));
        g.all_gather(&outputs, &outputs[r as usize]).unwrap().wait().unwrap();
        for (i, o) in outputs.iter().enumerate() {
            same(o, &values(kind, m, i as i64), &format!("in-place all_gather {kind:?} from {i}"));
        }
        // Out of place, as large: each rank's own block is written beside its arena copy
        // (other values than above, which the arena's slots still hold).
        let outputs: Vec<Tensor> = (0..n).map(|_| Tensor::zeros([m], (kind, Device::Cpu))).collect();
        g.all_gather(&outputs, &values(kind, m, r + n)).unwrap().wait().unwrap();
        for (i, o) in outputs.iter().enumerate() {
            same(o, &values(kind, m, i as i64 + n), &format!("all_gather {kind:?} x{m} from {i}"));
        }
        // Reduce-scatter of 5 elements per rank, of zero elements, and of more than a chunk.
        for m in [5, 0, 300_001] {
            let inputs: Vec<Tensor> = (0..n).map(|i| values(kind, m, r + i)).collect();
            let output = Tensor::zeros([m], (kind, Device::Cpu));
            g.reduce_scatter(&output, &inputs, ReduceOp::Sum).unwrap().wait().unwrap();
            same(
                &output,
                &(values(kind, m, 0) * n + ranks_sum + n * r).to_kind(kind),
                &format!("reduce_scatter {kind:?} x{m}"),
            );
            same(&inputs[0], &values(kind, m, r), "reduce_scatter leaves its inputs alone");
        }
        // In place (the output is this rank's input), with max and, for floats, avg.
        let m = 300_001;
        let flat = Tensor::cat(&(0..n).map(|i| values(kind, m, 2 * (r + i))).collect::<Vec<_>>(), 0);
        let inputs: Vec<Tensor> = (0..n).map(|i| flat.narrow(0, i * m, m)).collect();
        g.reduce_scatter(&inputs[r as usize], &inputs, ReduceOp::Max).unwrap().wait().unwrap();
        same(&inputs[r as usize], &values(kind, m, 2 * (n - 1 + r)), &format!("in-place reduce_scatter max {kind:?}"));
        if matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) {
            let inputs: Vec<Tensor> = (0..n).map(|i| values(kind, m, 2 * (r + i))).collect();
            let output = Tensor::zeros([m], (kind, Device::Cpu));
            g.reduce_scatter(&output, &inputs, ReduceOp::Avg).unwrap().wait().unwrap();
            // The mean of 2(q + r) over ranks q is (n - 1) + 2r.
            same(&output, &values(kind, m, n - 1 + 2 * r), &format!("reduce_scatter avg {kind:?}"));
        }
        // All-to-all: rank r sends [10r + j, 10r + j] to rank j.
        let inputs: Vec<Tensor> = (0..n).map(|j| Tensor::full([2], 10 * r + j, (kind, Device::Cpu))).collect();
        let outputs: Vec<Tensor> = (0..n).map(|_| Tensor::zeros([2], (kind, Device::Cpu))).collect();
        g.all_to_all(&outputs, &inputs).unwrap().wait().unwrap();
        for (j, o) in outputs.iter().enumerate() {
            same(
                o,
                &Tensor::full([2], 10 * j as i64 + r, (kind, Device::Cpu)),
                &format!("all_to_all {kind:?} from {j}"),
            );
        }
        // Send to the next rank, receive from the previous (even ranks send first).
        let out = values(kind, 100, r);
        let got = Tensor::zeros([100], (kind, Device::Cpu));
        let (next, prev) = (((r + 1) % n) as usize, ((r + n - 1) % n) as usize);
        let works = if r % 2 == 0 {
            [g.send(&out, next).unwrap(), g.recv(&got, prev).unwrap()]
        } else {
            [g.recv(&got, prev).unwrap(), g.send(&out, next).unwrap()]
        };
        works.iter().for_each(|w| w.wait().unwrap());
        same(&got, &values(kind, 100, prev as i64), &format!("send/recv {kind:?}"));
    }
    // Broadcast of 20 MB (shm: through the arena, in pieces, the last one partial).
    let t = Tensor::zeros([5_000_001], (Kind::Float, Device::Cpu));
    broadcast_from_both_ends(g, &t, |offset| distinct(5_000_001, offset), "broadcast");
    // Asynchronous handles: several calls in flight, completed in order.
    let ts: Vec<Tensor> = (0..4).map(|i| Tensor::full([1000], r + i, (Kind::Float, Device::Cpu))).collect();
    let works: Vec<_> = ts.iter().map(|t| g.all_reduce(t, ReduceOp::Sum).unwrap()).collect();
    for (i, (w, t)) in works.iter().zip(&ts).enumerate() {
        w.wait().unwrap();
        assert!(w.is_completed());
        same(t, &Tensor::full([1000], ranks_sum + n * i as i64, (Kind::Float, Device::Cpu)), "async all_reduce");
    }
    g.barrier().unwrap().wait().unwrap();
    // Bad arguments are errors at the call, before anything is sent.
    assert!(
        g.all_gather(
            &[Tensor::zeros([1], (Kind::Float, Device::Cpu))],
            &Tensor::zeros([1], (Kind::Float, Device::Cpu))
        )
        .is_err()
            || n == 1
    );
    assert!(g.broadcast(&Tensor::zeros([1], (Kind::Float, Device::Cpu)), n as usize).is_err());
    assert!(g.all_reduce(&Tensor::zeros([4, 4], (Kind::Float, Device::Cpu)).transpose(0, 1), ReduceOp::Sum).is_err());
}

#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    let comm = connect();
    let world = comm.world().unwrap();
    match scenario.as_str() {
        "collectives" => {
            check_collectives(world.as_ref());
            if std::env::var("STRATA_TEST_BACKEND").is_ok_and(|b| b == "shm") {
                check_shared_buffers(world.as_ref());
            }
            // A sub-group of the first and last rank works on its own.
            let last = comm.size() - 1;
            let sub = comm.new_group(&[0, last]).unwrap();
            assert_eq!(sub.is_some(), comm.rank() == 0 || comm.rank() == last);
            if let Some(sub) = sub {
                let t = Tensor::full([3], comm.rank() as i64, (Kind::Int64, Device::Cpu));
                sub.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
                same(&t, &Tensor::full([3], last as i64, (Kind::Int64, Device::Cpu)), "sub-group all_reduce");
            }
            world.barrier().unwrap().wait().unwrap();
        }
        "killed-peer" => {
            let t = Tensor::ones([8 << 20], (Kind::Float, Device::Cpu));
            let work = world.all_reduce(&t, ReduceOp::Sum).unwrap();
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(5));
                // SAFETY: ends this process on purpose, mid-collective.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            let err = work.wait().expect_err("a collective with a dead peer cannot succeed");
            println!("FAILED-CLEANLY: {err}");
        }
        "idle-wait" => {
            // Rank 0 arrives late; rank 1 waits for it inside an all-reduce.
            world.barrier().unwrap().wait().unwrap();
            let seen = Arc::new(Seen::default());
            comm.observe(Some(seen.clone()));
            let t = Tensor::ones([1024], (Kind::Float, Device::Cpu));
            if comm.rank() == 0 {
                std::thread::sleep(Duration::from_millis(400));
            }
            let (cpu_before, waited_before) = (cpu_time(), strata::comm::time_waited());
            let blocked = Instant::now();
            world.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
            let blocked = blocked.elapsed();
            let (cpu, waited) = (cpu_time() - cpu_before, strata::comm::time_waited() - waited_before);
            if comm.rank() == 1 {
                println!("waited {waited:?} of {blocked:?} using {cpu:?} of CPU");
                // The time blocked in `wait` is what the counter adds up.
                assert!(waited <= blocked && waited >= blocked.mul_f64(0.9), "{waited:?} counted of {blocked:?}");
                // A spinning waiter would burn CPU for as long as the peer is late (400 ms);
                // a sleeping one uses a little for its wake-ups, however busy the machine is.
                assert!(cpu < Duration::from_millis(40), "a waiting rank sleeps: it used {cpu:?} of CPU");
                // The observer was told of the one wait, the very stretch the counter added.
                assert_eq!(*seen.waits.lock().unwrap(), vec![waited]);
            }
            // Every rank's observer saw its one collective finish, with its bytes.
            let collectives = seen.collectives.lock().unwrap().clone();
            assert_eq!(collectives, vec![("all_reduce", 4096)]);
        }
        other => panic!("unknown scenario {other}"),
    }
    println!("RANK-OK");
}

/// Broadcasts `t` from the first and from the last rank, each rank's values (`values_at`
/// an offset) differing from every other rank's and from the other broadcast's.
fn broadcast_from_both_ends(g: &dyn ProcessGroup, t: &Tensor, values_at: impl Fn(i64) -> Tensor, what: &str) {
    let (r, n) = (g.rank() as i64, g.size() as i64);
    for root in [0, n - 1] {
        t.shallow_clone().copy_(&values_at(r + 5 * root));
        g.broadcast(t, root as usize).unwrap().wait().unwrap();
        same(t, &values_at(6 * root), &format!("{what} x{} from {root}", t.numel()));
    }
}

/// Collectives on buffers the group allocated (shared memory the peers read in place),
/// in sizes above and below an arena chunk, in place and not.
fn check_shared_buffers(g: &dyn ProcessGroup) {
    let (r, n) = (g.rank() as i64, g.size() as i64);
    let ranks_sum = n * (n - 1) / 2;
    let shared =
        |kind: Kind, numel: i64| g.alloc(numel, kind, Device::Cpu).unwrap().expect("shm shares memory on this host");
    let fill = |t: &Tensor, v: &Tensor| {
        t.shallow_clone().copy_(v);
    };
    for kind in [Kind::Float, Kind::BFloat16, Kind::Int64] {
        for numel in [1, 1031, 300_001] {
            let what = |op: &str| format!("shared {op} {kind:?} x{numel}");
            let t = shared(kind, numel);
            assert_eq!(t.numel() as i64, numel);
            fill(&t, &values(kind, numel, r));
            g.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
            same(&t, &(values(kind, numel, 0) * n + ranks_sum).to_kind(kind), &what("all_reduce sum"));
            fill(&t, &values(kind, numel, r));
            g.all_reduce(&t, ReduceOp::Max).unwrap().wait().unwrap();
            same(&t, &values(kind, numel, n - 1), &what("all_reduce max"));
            // All-gather from a shared input into private outputs.
            let input = shared(kind, numel);
            fill(&input, &values(kind, numel, r));
            let outputs: Vec<Tensor> = (0..n).map(|_| Tensor::zeros([numel], (kind, Device::Cpu))).collect();
            g.all_gather(&outputs, &input).unwrap().wait().unwrap();
            for (i, o) in outputs.iter().enumerate() {
                same(o, &values(kind, numel, i as i64), &what("all_gather"));
            }
            // Reduce-scatter of views of one shared buffer, into a private output and in place.
            let flat = shared(kind, numel * n);
            fill(&flat, &Tensor::cat(&(0..n).map(|i| values(kind, numel, r + i)).collect::<Vec<_>>(), 0));
            let inputs: Vec<Tensor> = (0..n).map(|i| flat.narrow(0, i * numel, numel)).collect();
            let output = Tensor::zeros([numel], (kind, Device::Cpu));
            g.reduce_scatter(&output, &inputs, ReduceOp::Sum).unwrap().wait().unwrap();
            same(&output, &(values(kind, numel, 0) * n + ranks_sum + n * r).to_kind(kind), &what("reduce_scatter"));
            same(&inputs[0], &values(kind, numel, r), &what("reduce_scatter leaves its inputs alone"));
            g.reduce_scatter(&inputs[r as usize], &inputs, ReduceOp::Sum).unwrap().wait().unwrap();
            same(&inputs[r as usize], &output, &what("in-place reduce_scatter"));
            // Broadcast from the first and from the last rank (below 4 MiB: shm's chain).
            broadcast_from_both_ends(g, &t, |offset| values(kind, numel, offset), &what("broadcast"));
        }
    }
    // Shared memory is host memory: a group has none to offer for a device it does not serve.
    assert!(g.alloc(4, Kind::Float, Device::Cuda(0)).unwrap().is_none());
    // Broadcast of 20 MB (shm: read in place).
    broadcast_from_both_ends(
        g,
        &shared(Kind::Float, 5_000_001),
        |offset| distinct(5_000_001, offset),
        "shared broadcast",
    );
    // Avg in place on a shared buffer.
    let t = shared(Kind::Float, 5000);
    fill(&t, &values(Kind::Float, 5000, 2 * r));
    g.all_reduce(&t, ReduceOp::Avg).unwrap().wait().unwrap();
    same(&t, &values(Kind::Float, 5000, n - 1), "shared all_reduce avg");
}

/// What a communication observer was told: (operation, bytes) per collective, and how
/// long each blocking wait took.
#[derive(Default)]
struct Seen {
    collectives: Mutex<Vec<(&'static str, u64)>>,
    waits: Mutex<Vec<Duration>>,
}

impl CommObserver for Seen {
    fn collective(&self, c: &Collective) {
        assert!(c.issued <= c.finished);
        self.collectives.lock().unwrap().push((c.op, c.bytes));
    }
    fn waited(&self, w: &Waited) {
        self.waits.lock().unwrap().push(w.ended - w.began);
    }
}

/// CPU time this process has used, all threads.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    Duration::from_micros(micros(usage.ru_utime) + micros(usage.ru_stime))
}

/// A rank waiting for a late peer sleeps in the kernel instead of spinning (so it takes no
/// core from ranks that compute), and its wait is counted as exposed communication and told
/// to the job's observer with the collective itself.
#[test]
fn a_rank_waiting_for_a_late_peer_sleeps_and_counts_the_wait() {
    assert_all_ok(&run_ranks(2, "shm", "idle-wait"));
}

/// Without a CUDA build and a GPU the nccl backend refuses clearly; with them, a one-rank
/// group runs its collectives on the device (more ranks need more GPUs than a test box has).
#[test]
fn nccl_groups_need_a_gpu_and_work_on_one() {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").unwrap();
    let store = Store::connect(server.addr(), "t", Duration::from_secs(5)).unwrap();
    let comm = Comm::new(store, None, 0, 1, "cpu:shm,cuda:nccl", Duration::from_secs(30)).unwrap();
    let world = match comm.world() {
        Err(e) => {
            assert!(e.to_string().contains("nccl backend needs"), "{e}");
            return;
        }
        Ok(g) => g,
    };
    let gpu = (Kind::Float, Device::Cuda(0));
    let t = Tensor::arange(1000, gpu);
    world.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
    same(&t, &Tensor::arange(1000, gpu), "nccl all_reduce over one rank");
    let outs = vec![Tensor::zeros([3], gpu)];
    world.all_gather(&outs, &Tensor::ones([3], gpu)).unwrap().wait().unwrap();
    same(&outs[0], &Tensor::ones([3], gpu), "nccl all_gather");
    let out = Tensor::zeros([4], gpu);
    world.reduce_scatter(&out, &[Tensor::full([4], 2.0, gpu)], ReduceOp::Sum).unwrap().wait().unwrap();
    same(&out, &Tensor::full([4], 2.0, gpu), "nccl reduce_scatter");
    // CPU tensors still go to the CPU backend of the same spec.
    let c = Tensor::ones([5], (Kind::Float, Device::Cpu));
    world.all_reduce(&c, ReduceOp::Sum).unwrap().wait().unwrap();
    world.barrier().unwrap().wait().unwrap();
}

/// A group of one rank whose all-reduce multiplies by ten, so a collective shows which
/// backend ran it; every other collective is the trait's "does not support".
struct TimesTen;

impl ProcessGroup for TimesTen {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn backend(&self) -> &str {
        "times-ten"
    }
    fn all_reduce(&self, tensor: &Tensor, _op: ReduceOp) -> strata::Result<strata::comm::Work> {
        let _ = tensor.shallow_clone().f_mul_scalar_(10.0)?;
        Ok(strata::comm::Work::done())
    }
}

/// A backend registered by name serves spec strings that name it; unknown names list the
/// registered ones.
#[test]
fn a_registered_backend_serves_the_groups_of_specs_that_name_it() {
    let built = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = built.clone();
    strata::comm::register_backend(
        "times-ten",
        Arc::new(move |setup: &strata::comm::GroupSetup| {
            assert_eq!((setup.rank, setup.size), (0, 1));
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(Box::new(TimesTen) as Box<dyn ProcessGroup>)
        }),
    );
    let comm = |spec: &str| {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").unwrap();
        let store = Store::connect(server.addr(), "t", Duration::from_secs(10)).unwrap();
        Comm::new(store, Some(server), 0, 1, spec, Duration::from_secs(10))
    };
    let world = comm("cpu:times-ten").unwrap().world().unwrap();
    assert_eq!(world.backend(), "cpu:times-ten", "the world dispatches CPU tensors to it");
    let t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    world.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [10.0; 4]);
    assert!(built.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    let err = world.broadcast(&t, 0).err().expect("unsupported").to_string();
    assert!(err.contains("backend times-ten does not support broadcast"), "{err}");
    let err = comm("cpu:nope").and_then(|c| c.world().map(|_| ())).expect_err("unknown").to_string();
    assert!(err.contains("unknown backend \"nope\"") && err.contains("times-ten"), "{err}");
}

/// Ranks that made different numbers of groups (work that failed part-way on one of them)
/// name their next group alike once their counts are aligned: a collective on it completes
/// (without the alignment each rank would wait under its own name until the timeout).
#[test]
fn aligned_group_counts_let_ranks_that_made_different_numbers_of_groups_meet_again() {
    let sums = common::ranks::threads(2, Duration::from_secs(5), |rank, comm| {
        let world = comm.world().unwrap();
        if rank == 0 {
            // A group the other rank never got to make.
            assert!(comm.new_group(&[0]).unwrap().is_some());
        }
        comm.align_groups(world.as_ref()).unwrap();
        let pair = comm.new_group(&[0, 1]).unwrap().unwrap();
        let t = Tensor::ones([3], (Kind::Float, Device::Cpu));
        pair.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        Vec::<f32>::try_from(&t).unwrap()
    });
    assert_eq!(sums, [[2.0; 3], [2.0; 3]]);
}

/// A rank whose attempt failed gives up on it: a peer waiting for it in a collective of
/// the attempt's groups, or for it to make one of them, fails within a poll, naming the
/// reason, long before the group's timeout (two minutes here), even while the rank that gave
/// up keeps its groups open; and the job goes on in the groups made after the attempt.
#[test]
fn ranks_waiting_on_a_rank_that_gave_up_fail_with_its_reason_and_the_job_goes_on() {
    let outcomes = common::ranks::threads(2, Duration::from_secs(120), |rank, comm| {
        // Made before the attempt, the world outlives it.
        let world = comm.world().unwrap();
        let attempt = comm.attempt();
        let pair = comm.new_group(&[0, 1]).unwrap().unwrap();
        let waited = if rank == 1 {
            // Rank 0 never sends, and never makes the second group.
            let t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
            let in_collective = pair.recv(&t, 0).unwrap().wait().unwrap_err().to_string();
            let making_a_group = comm.new_group(&[0, 1]).err().expect("rank 0 never makes it").to_string();
            Some([in_collective, making_a_group])
        } else {
            attempt.give_up("stage 0 ran out of memory").unwrap();
            None
        };
        drop(attempt);
        // Rank 1 counted the group it tried to make.
        comm.align_groups(world.as_ref()).unwrap();
        let after = comm.new_group(&[0, 1]).unwrap().unwrap();
        let t = Tensor::ones([3], (Kind::Float, Device::Cpu));
        after.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        drop(pair);
        (waited, Vec::<f32>::try_from(&t).unwrap())
    });
    for message in outcomes[1].0.as_ref().unwrap() {
        assert!(message.contains("gave up on this group: rank 0: stage 0 ran out of memory"), "{message}");
    }
    assert!(outcomes.iter().all(|(_, sums)| sums == &[2.0; 3]), "{outcomes:?}");
}
