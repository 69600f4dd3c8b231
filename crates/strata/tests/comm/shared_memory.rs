//! Memory a group hands out for its peers to read in place (`ProcessGroup::alloc`) is host
//! memory like any tensor's: it shows in the CPU allocator's statistics while it lives and
//! leaves them when its last tensor goes. Alone in its binary, so that no other test's
//! tensors move the counts.
use std::time::Duration;
use strata::comm::{Comm, Store, StoreServer};
use tch::{Device, Kind};

#[test]
fn shared_buffers_count_in_the_cpu_allocator_statistics() {
    strata_ext::cpu_memory::track().unwrap();
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "shared-test").unwrap();
    let addr = server.addr();
    let mut hosted = Some(server);
    let comms: Vec<Comm> = std::thread::scope(|scope| {
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                let host = if rank == 0 { hosted.take() } else { None };
                scope.spawn(move || {
                    let store = Store::connect(addr, "shared-test", Duration::from_secs(30)).unwrap();
                    Comm::new(store, host, rank, 2, "cpu:shm", Duration::from_secs(30)).unwrap()
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let groups: Vec<_> = std::thread::scope(|scope| {
        let joins: Vec<_> = comms.iter().map(|c| scope.spawn(move || c.world().unwrap())).collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let current = || strata_ext::cpu_memory::stats().unwrap().0;
    let before = current();
    let buffers: Vec<_> = groups.iter().map(|g| g.alloc(1 << 20, Kind::Float, Device::Cpu).unwrap().unwrap()).collect();
    assert!(buffers.iter().all(strata::comm::in_shared_memory));
    assert_eq!(current() - before, 2 * (4 << 20), "two shared buffers of 4 MiB are counted");
    drop(buffers);
    assert_eq!(current(), before, "and uncounted once dropped");
}
