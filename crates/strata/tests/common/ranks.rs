//! Multi-process tests: a driver test hosts a store and starts several copies of its own
//! test binary, each running the `rank_entry` test of the driver's module as one rank of a
//! scenario.
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use strata::comm::{Comm, Store, StoreServer};

/// Starts `n` ranks of `scenario` on `backend` and returns their outputs, in rank order.
#[track_caller]
pub fn run_ranks(n: usize, backend: &str, scenario: &str) -> Vec<Output> {
    run_ranks_with(n, backend, scenario, |_| vec![])
}

/// As [`run_ranks`], with `vars(rank)` set in each rank's environment.
#[track_caller]
pub fn run_ranks_with(
    n: usize,
    backend: &str,
    scenario: &str,
    vars: impl Fn(usize) -> Vec<(&'static str, &'static str)>,
) -> Vec<Output> {
    // The caller's module (its file's name in the binary's folder) holds the entry.
    let module = std::path::Path::new(std::panic::Location::caller().file()).file_stem().unwrap().to_string_lossy();
    let entry = format!("{module}::rank_entry");
    let token = "test-token";
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), token).unwrap();
    let children: Vec<Child> = (0..n)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", &entry, "--nocapture", "--test-threads", "1"])
                .env("STRATA_TEST_SCENARIO", scenario)
                .env("STRATA_TEST_BACKEND", backend)
                .env("STRATA_TEST_STORE", server.addr().to_string())
                .env("STRATA_TEST_TOKEN", token)
                .env("STRATA_STORE_TOKEN", token)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .envs(vars(rank))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut children: Vec<Option<Child>> = children.into_iter().map(Some).collect();
    // Bounded wait: a hung rank is killed and shows up as a failure, never a hung test.
    // Every child is polled each round, so finished ones are reaped as they finish.
    let running = |cs: &mut [Option<Child>]| {
        cs.iter_mut().flatten().map(|c| c.try_wait().ok().flatten().is_none()).filter(|&r| r).count()
    };
    while running(&mut children) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .iter_mut()
        .map(|c| {
            let mut c = c.take().unwrap();
            let _ = c.kill();
            c.wait_with_output().unwrap()
        })
        .collect()
}

pub fn assert_all_ok(outputs: &[Output]) {
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("RANK-OK"),
            "rank {rank} failed ({:?}):\n{}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// This rank's communicator, as the driver of [`run_ranks`] described it.
pub fn connect() -> Comm {
    let var = |k: &str| std::env::var(k).unwrap();
    let store =
        Store::connect(var("STRATA_TEST_STORE").parse().unwrap(), &var("STRATA_TEST_TOKEN"), Duration::from_secs(30))
            .unwrap();
    // RANK and WORLD_SIZE from the driver, or Open MPI's variables under mpirun.
    let info = strata::comm::RankInfo::from_env().unwrap();
    let (rank, size) = (info.rank, info.world_size);
    // A backend name means CPU tensors; a spec ("cpu:shm,cuda:shm") names each device's.
    let backend = var("STRATA_TEST_BACKEND");
    let spec = if backend.contains(':') { backend } else { format!("cpu:{backend}") };
    Comm::new(store, None, rank, size, &spec, Duration::from_secs(20)).unwrap()
}

/// Runs `work` on `n` ranks as threads of this process, each with a communicator over TCP
/// (a store of their own on loopback, collectives waiting up to `timeout`); its results, in
/// rank order.
#[allow(dead_code)] // test binaries that include this file alone may not use it
pub fn threads<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    work: impl Fn(usize, Comm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let token = "threads";
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), token).unwrap();
    let addr = server.addr();
    let mut server = Some(server);
    let work = std::sync::Arc::new(work);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let hosted = if rank == 0 { server.take() } else { None };
            let work = work.clone();
            std::thread::spawn(move || {
                let store = Store::connect(addr, token, Duration::from_secs(30)).unwrap();
                work(rank, Comm::new(store, hosted, rank, n, "cpu:tcp", timeout).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}
