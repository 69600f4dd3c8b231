//! The rendezvous store: a TCP key-value server and its client (set, get, add, wait with a
//! timeout, compare-and-set), used to form groups and exchange addresses and ids. Under
//! torchrun the client speaks to PyTorch's own c10d `TCPStore` instead, which torchrun's agent
//! already hosts; Strata's server stays for `strata launch`, Slurm and Open MPI because c10d's
//! store admits any client, and a token check layered on it could not keep others from its
//! keys.
//!
//! The server binds to the address it is given (loopback unless told otherwise) and serves
//! only clients that prove they hold the job's token (`super::auth`); others are told so
//! and dropped, as are clients that stall in the handshake; beyond `MAX_PENDING`
//! handshakes at once, new connections wait in the listen backlog. A request that is not one
//! ends its connection; missing arguments read as empty. Nothing a client sends ends the
//! server.
use super::auth::{self, read_frame, write_frame};
use crate::{Error, Result};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Largest frame an authenticated client may send, so a bug cannot make the server
/// allocate freely.
const MAX_FRAME: usize = 64 << 20;
/// Connections in their handshake at once; more wait to be accepted.
const MAX_PENDING: usize = 64;
/// Longest wait a client may ask for; longer ones are cut to it.
const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Op {
    Set = 1,
    Get = 2,
    Add = 3,
    CompareSet = 4,
    Wait = 5,
    Check = 6,
}

impl Op {
    fn from_byte(b: u8) -> Option<Op> {
        [Op::Set, Op::Get, Op::Add, Op::CompareSet, Op::Wait, Op::Check].into_iter().find(|o| *o as u8 == b)
    }
}

const OK: u8 = 0;
const TIMEOUT: u8 = 1;

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.values.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every key exists or the deadline passes.
    fn wait_for(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Option<std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>>> {
        let deadline = Instant::now() + timeout.min(MAX_WAIT);
        let mut map = self.lock();
        while !keys.iter().all(|k| map.contains_key(k)) {
            let left = deadline.checked_duration_since(Instant::now())?;
            map = self.changed.wait_timeout(map, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        Some(map)
    }
}

/// The store's server; it stops accepting when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free one) and serves clients presenting `token`.
    pub fn start(addr: SocketAddr, token: &str) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::Comm(format!("store cannot bind {addr}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::Comm(format!("store address: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let token = token.as_bytes().to_vec();
        let stopping = stop.clone();
        let pending = Arc::new(AtomicUsize::new(0));
        let accept = std::thread::Builder::new()
            .name("strata-store".into())
            .spawn(move || {
                while !stopping.load(Ordering::SeqCst) {
                    // At the cap, later clients wait in the listen backlog, not refused.
                    if pending.load(Ordering::SeqCst) >= MAX_PENDING {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    let Ok((conn, _)) = listener.accept() else { continue };
                    if stopping.load(Ordering::SeqCst) {
                        break;
                    }
                    let handshake = Handshake::start(&pending);
                    let (table, token) = (table.clone(), token.clone());
                    // One thread per client: a job has as many clients as ranks. A thread
                    // that cannot start drops the connection and its count.
                    let _ = std::thread::Builder::new().name("strata-store-client".into()).spawn(move || {
                        let _ = serve(conn, &table, &token, handshake);
                    });
                }
            })
            .map_err(|e| Error::Comm(format!("cannot start the store thread: {e}")))?;
        Ok(StoreServer { addr, stop, accept: Some(accept) })
    }

    /// The address it listens on (the port chosen where `start` was given 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn millis(b: &[u8]) -> Duration {
    Duration::from_millis(b.try_into().map(u64::from_le_bytes).unwrap_or(0))
}

/// One connection still in its handshake, counted against [`MAX_PENDING`] until dropped.
struct Handshake(Arc<AtomicUsize>);

impl Handshake {
    fn start(pending: &Arc<AtomicUsize>) -> Handshake {
        pending.fetch_add(1, Ordering::SeqCst);
        Handshake(pending.clone())
    }
}

impl Drop for Handshake {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve(mut conn: TcpStream, table: &Table, token: &[u8], handshake: Handshake) -> Result<()> {
    let joined = conn
        .set_nodelay(true)
        .map_err(|e| Error::Comm(e.to_string()))
        .and_then(|()| auth::accept(&mut conn, token, |context| context == b"store"));
    drop(handshake);
    joined?;
    serve_requests(conn, table).map_err(|e| Error::Comm(e.to_string()))
}

/// Answers an authenticated client until it leaves or sends what is not a request.
fn serve_requests(mut conn: TcpStream, table: &Table) -> std::io::Result<()> {
    loop {
        let req = read_frame(&mut conn, MAX_FRAME, None)?;
        let Some(op) = req.first().and_then(|o| o.first()).and_then(|&b| Op::from_byte(b)) else {
            return Ok(());
        };
        let arg = |i: usize| req.get(i).map(Vec::as_slice).unwrap_or(&[]);
        match op {
            Op::Set => {
                table.lock().insert(text(arg(1)), arg(2).to_vec());
                table.changed.notify_all();
                write_frame(&mut conn, &[&[OK]])?;
            }
            Op::Get => match table.wait_for(&[text(arg(1))], millis(arg(2))) {
                Some(map) => {
                    let v = map.get(&text(arg(1))).cloned().unwrap_or_default();
                    drop(map);
                    write_frame(&mut conn, &[&[OK], &v])?;
                }
                None => write_frame(&mut conn, &[&[TIMEOUT]])?,
            },
            Op::Add => {
                let delta = arg(2).try_into().map(i64::from_le_bytes).unwrap_or(0);
                let mut map = table.lock();
                let entry = map.entry(text(arg(1))).or_default();
                let now = text(entry).parse::<i64>().unwrap_or(0).saturating_add(delta);
                *entry = now.to_string().into_bytes();
                drop(map);
                table.changed.notify_all();
                write_frame(&mut conn, &[&[OK], &now.to_le_bytes()])?;
            }
            Op::CompareSet => {
                let key = text(arg(1));
                let mut map = table.lock();
                let current = map.get(&key).cloned();
                let matches = match &current {
                    Some(v) => v.as_slice() == arg(2),
                    None => arg(2).is_empty(),
                };
                let result = if matches {
                    map.insert(key, arg(3).to_vec());
                    arg(3).to_vec()
                } else {
                    current.unwrap_or_default()
                };
                drop(map);
                table.changed.notify_all();
                write_frame(&mut conn, &[&[OK], &result])?;
            }
            Op::Wait => {
                let keys: Vec<String> = req.get(2..).unwrap_or_default().iter().map(|k| text(k)).collect();
                let status = if table.wait_for(&keys, millis(arg(1))).is_some() { OK } else { TIMEOUT };
                write_frame(&mut conn, &[&[status]])?;
            }
            Op::Check => {
                let map = table.lock();
                let all = req.get(1..).unwrap_or_default().iter().all(|k| map.contains_key(&text(k)));
                drop(map);
                write_frame(&mut conn, &[&[OK], &[all as u8]])?;
            }
        }
    }
}

/// A connection to the store. Calls are serialised; share it behind an `Arc`.
pub struct Store {
    backend: Backend,
    addr: SocketAddr,
    /// The job's token: the data mesh authenticates peers with it too.
    token: Vec<u8>,
    /// Default timeout of `get` and `wait`.
    pub timeout: Duration,
}

/// Whose store the job rendezvouses through.
enum Backend {
    /// Strata's own, authenticated with the job's token.
    Strata(Mutex<TcpStream>),
    /// PyTorch's c10d `TCPStore`, as torchrun's agent hosts it; every key lies under
    /// `prefix` (the run and its restart round).
    C10d { store: Mutex<strata_ext::c10d::TcpStore>, prefix: String },
}

impl Store {
    /// Connects to the store at `addr`, retrying until `timeout` while the server starts.
    pub fn connect(addr: SocketAddr, token: &str, timeout: Duration) -> Result<Store> {
        let deadline = Instant::now() + timeout;
        let mut conn = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(c) => break c,
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::Comm(format!("cannot reach the store at {addr} within {timeout:?}: {e}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        conn.set_nodelay(true).map_err(|e| Error::Comm(format!("store at {addr}: {e}")))?;
        auth::connect(&mut conn, token.as_bytes(), b"store", &format!("the store at {addr}"))?;
        let backend = Backend::Strata(Mutex::new(conn));
        Ok(Store { backend, addr, token: token.as_bytes().to_vec(), timeout })
    }

    /// Joins PyTorch's c10d store at `addr` (torchrun's), or hosts it there with `host`, as
    /// `rank` of `world` ranks, keeping every key under `prefix` and a name of the round
    /// its ranks agree on. That store has no token; the job's mesh token is made by rank
    /// 0 and shared through it, so the mesh admits what the store admits.
    pub fn connect_c10d(
        addr: SocketAddr,
        prefix: &str,
        (rank, world): (usize, usize),
        host: bool,
        timeout: Duration,
    ) -> Result<Store> {
        // c10d's client waits without limit for a server that accepts but never answers: it
        // connects on a thread of its own, abandoned if the timeout passes first.
        let (made, arrived) = std::sync::mpsc::channel();
        let ip = addr.ip().to_string();
        std::thread::Builder::new()
            .name("strata-c10d-connect".into())
            .spawn(move || {
                let _ = made.send(strata_ext::c10d::TcpStore::new(&ip, addr.port(), host, timeout));
            })
            .map_err(|e| Error::Comm(format!("cannot start a thread to join the store: {e}")))?;
        let client = match arrived.recv_timeout(timeout) {
            Ok(made) => made.map_err(|e| Error::Comm(format!("cannot join the store at {addr}: {e}")))?,
            Err(_) => return Err(Error::Comm(format!("the store at {addr} did not answer within {timeout:?}"))),
        };
        let backend = Backend::C10d { store: Mutex::new(client), prefix: prefix.to_string() };
        let mut store = Store { backend, addr, token: Vec::new(), timeout };
        let round = store.join_round(rank, world)?;
        if let Backend::C10d { prefix, .. } = &mut store.backend {
            prefix.push_str(&round);
            prefix.push('/');
        }
        if rank == 0 {
            store.set("mesh-token", random_token()?.as_bytes())?;
        }
        store.token = store.get("mesh-token")?;
        Ok(store)
    }

    /// The name of this round of the job, agreed by its ranks. torchrun's agent keeps one
    /// store across restarts, so keys of a dead round stay; and its restart count cannot name
    /// the round, as an agent whose node did not fail restarts its ranks without counting
    /// it. Rank 0 names the round with a fresh nonce; every other rank takes the name it
    /// finds and waits to be welcomed under it by the rank 0 that wrote it, moving to a new
    /// name if one appears (the one it found was a dead round's).
    fn join_round(&self, rank: usize, world: usize) -> Result<String> {
        if rank == 0 {
            let round = random_token()?;
            self.set("round", round.as_bytes())?;
            for r in 1..world {
                let nonce = text(&self.get(&format!("{round}/hello/{r}"))?);
                self.set(&format!("{round}/welcome/{nonce}"), b"1")?;
            }
            return Ok(round);
        }
        let deadline = Instant::now() + self.timeout;
        let nonce = random_token()?;
        let mut round = text(&self.get("round")?);
        loop {
            self.set(&format!("{round}/hello/{rank}"), nonce.as_bytes())?;
            let welcome = format!("{round}/welcome/{nonce}");
            loop {
                if self.check(&[&welcome])? {
                    return Ok(round);
                }
                if Instant::now() >= deadline {
                    return Err(self.timed_out("rank 0 to open the job's round", self.timeout));
                }
                std::thread::sleep(Duration::from_millis(20));
                let named = text(&self.get("round")?);
                if named != round {
                    round = named;
                    break;
                }
            }
        }
    }

    pub(crate) fn token(&self) -> &[u8] {
        &self.token
    }

    /// The local address this process reaches the store from: the interface peers on
    /// other hosts can reach it through.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        let failed = |e: std::io::Error| Error::Comm(format!("store connection: {e}"));
        match &self.backend {
            Backend::Strata(conn) => {
                conn.lock().unwrap_or_else(|e| e.into_inner()).local_addr().map(|a| a.ip()).map_err(failed)
            }
            // The route to the store's host picks the interface (a datagram socket sends nothing).
            Backend::C10d { .. } => {
                let probe = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)).map_err(failed)?;
                probe.connect(self.addr).map_err(failed)?;
                probe.local_addr().map(|a| a.ip()).map_err(failed)
            }
        }
    }

    fn call(&self, parts: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        let Backend::Strata(conn) = &self.backend else { return Err(Error::Comm("not a Strata store".into())) };
        let mut conn = conn.lock().unwrap_or_else(|e| e.into_inner());
        let io = |e: std::io::Error| Error::Comm(format!("store at {}: {e}", self.addr));
        write_frame(&mut conn, parts).map_err(io)?;
        read_frame(&mut conn, MAX_FRAME, None).map_err(io)
    }

    /// Runs `f` on the c10d client with `keys` under its prefix; `None` for Strata's store.
    fn c10d<T>(
        &self,
        keys: &[&str],
        f: impl FnOnce(&strata_ext::c10d::TcpStore, &[&str]) -> strata_ext::Result<T>,
    ) -> Option<Result<T>> {
        let Backend::C10d { store, prefix } = &self.backend else { return None };
        let full: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        let store = store.lock().unwrap_or_else(|e| e.into_inner());
        Some(f(&store, &refs).map_err(|e| Error::Comm(format!("store at {}: {e}", self.addr))))
    }

    fn timed_out(&self, what: &str, timeout: Duration) -> Error {
        Error::Comm(format!("store at {}: timed out after {timeout:?} waiting for {what}", self.addr))
    }

    /// Sets `key` to `value`, replacing any value it had, and wakes those waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        if let Some(r) = self.c10d(&[key], |s, k| s.set(k[0], value)) {
            return r;
        }
        self.call(&[&[Op::Set as u8], key.as_bytes(), value]).map(drop)
    }

    /// The value of `key`, waiting up to the store's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        if let Some(r) = self.c10d(&[key], |s, k| s.get(k[0], timeout)) {
            return r.map_err(|_| self.timed_out(&format!("key {key:?}"), timeout));
        }
        let r = self.call(&[&[Op::Get as u8], key.as_bytes(), &(timeout.as_millis() as u64).to_le_bytes()])?;
        match r.first().map(Vec::as_slice) {
            Some([OK]) => Ok(r.get(1).cloned().unwrap_or_default()),
            _ => Err(self.timed_out(&format!("key {key:?}"), timeout)),
        }
    }

    /// Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        if let Some(r) = self.c10d(&[key], |s, k| s.add(k[0], delta)) {
            return r;
        }
        let r = self.call(&[&[Op::Add as u8], key.as_bytes(), &delta.to_le_bytes()])?;
        let bytes: [u8; 8] = r
            .get(1)
            .and_then(|v| v.as_slice().try_into().ok())
            .ok_or_else(|| Error::Comm("store: malformed add reply".into()))?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Sets `key` to `desired` if its value is `expected` (empty `expected`: if unset);
    /// returns the value after the call either way.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        if let Some(r) = self.c10d(&[key], |s, k| s.compare_set(k[0], expected, desired)) {
            return r;
        }
        let r = self.call(&[&[Op::CompareSet as u8], key.as_bytes(), expected, desired])?;
        Ok(r.get(1).cloned().unwrap_or_default())
    }

    /// Waits until every key is set.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if let Some(r) = self.c10d(keys, |s, k| s.wait(k, timeout)) {
            return r.map_err(|_| self.timed_out(&format!("keys {keys:?}"), timeout));
        }
        let ms = (timeout.as_millis() as u64).to_le_bytes();
        let mut parts: Vec<&[u8]> = vec![&[Op::Wait as u8], &ms];
        parts.extend(keys.iter().map(|k| k.as_bytes()));
        let r = self.call(&parts)?;
        match r.first().map(Vec::as_slice) {
            Some([OK]) => Ok(()),
            _ => Err(self.timed_out(&format!("keys {keys:?}"), timeout)),
        }
    }

    /// Whether every key is set, without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        if let Some(r) = self.c10d(keys, |s, k| s.check(k)) {
            return r;
        }
        let mut parts: Vec<&[u8]> = vec![&[Op::Check as u8]];
        parts.extend(keys.iter().map(|k| k.as_bytes()));
        Ok(self.call(&parts)?.get(1).map(Vec::as_slice) == Some(&[1]))
    }
}

/// A fresh random token for a job (hex of 16 bytes from the system's random source).
pub fn random_token() -> Result<String> {
    Ok(auth::random_bytes::<16>()?.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::{Read, Write};

    /// A request frame: an operation byte (valid or not) and random parts, with the waits of
    /// `get` and `wait` kept short so a case cannot block on a key nobody sets.
    fn request() -> impl Strategy<Value = Vec<Vec<u8>>> {
        let part = prop::collection::vec(any::<u8>(), 0..12);
        (0u8..9, prop::collection::vec(part, 0..5), 0u64..30).prop_map(|(op, mut parts, ms)| {
            let short = ms.to_le_bytes().to_vec();
            match op {
                2 if parts.len() >= 2 => parts[1] = short,
                5 if !parts.is_empty() => parts[0] = short,
                _ => {}
            }
            std::iter::once(vec![op]).chain(parts).collect()
        })
    }

    /// A round left in torchrun's store by a dead round (its name, a rank's hello under it)
    /// is passed over: rank 1 finds it first, says hello under it, then follows the new
    /// round rank 0 opens, and the two share keys under it.
    #[test]
    fn a_dead_round_left_in_a_c10d_store_is_passed_over() {
        let timeout = Duration::from_secs(20);
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server = strata_ext::c10d::TcpStore::new("127.0.0.1", port, true, timeout).unwrap();
        server.set("strata/job/round", b"dead").unwrap();
        server.set("strata/job/dead/mesh-token", b"stale").unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let rank1 = std::thread::spawn(move || Store::connect_c10d(addr, "strata/job/", (1, 2), false, timeout));
        // Rank 1 has taken the dead round's name before rank 0 starts.
        server.wait(&["strata/job/dead/hello/1"], timeout).unwrap();
        let rank0 = Store::connect_c10d(addr, "strata/job/", (0, 2), false, timeout).unwrap();
        let rank1 = rank1.join().unwrap().unwrap();
        assert_eq!(rank0.token(), rank1.token(), "one mesh token");
        assert_ne!(rank1.token(), b"stale");
        rank0.set("shared", b"yes").unwrap();
        assert_eq!(rank1.get_timeout("shared", timeout).unwrap(), b"yes");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        #[test]
        fn any_request_is_answered_or_ends_its_connection_without_a_panic(
            frames in prop::collection::vec(request(), 1..5)
        ) {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let client = std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                for f in frames {
                    let refs: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
                    if write_frame(&mut s, &refs).is_err() {
                        break;
                    }
                    if read_frame(&mut s, MAX_FRAME, Some(Instant::now() + Duration::from_secs(2))).is_err() {
                        break;
                    }
                }
            });
            let (conn, _) = listener.accept().unwrap();
            let table = Table::default();
            table.lock().insert("k".into(), b"7".to_vec());
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve_requests(conn, &table)));
            client.join().unwrap();
            prop_assert!(served.is_ok(), "the server thread panicked");
        }
    }

    fn local() -> (StoreServer, Store) {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "secret").unwrap();
        let client = Store::connect(server.addr(), "secret", Duration::from_secs(5)).unwrap();
        (server, client)
    }

    #[test]
    fn set_get_add_compare_set_and_check() {
        let (_server, s) = local();
        s.set("a", b"1").unwrap();
        assert_eq!(s.get("a").unwrap(), b"1");
        assert_eq!(s.add("n", 5).unwrap(), 5);
        assert_eq!(s.add("n", -2).unwrap(), 3);
        assert_eq!(s.compare_set("c", b"", b"x").unwrap(), b"x", "unset key: set");
        assert_eq!(s.compare_set("c", b"y", b"z").unwrap(), b"x", "mismatch: unchanged");
        assert_eq!(s.compare_set("c", b"x", b"z").unwrap(), b"z");
        assert!(s.check(&["a", "n"]).unwrap());
        assert!(!s.check(&["a", "missing"]).unwrap());
    }

    #[test]
    fn get_and_wait_block_until_another_client_sets_or_time_out() {
        let (server, s) = local();
        let addr = server.addr();
        let setter = std::thread::spawn(move || {
            let other = Store::connect(addr, "secret", Duration::from_secs(5)).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            other.set("late", b"v").unwrap();
        });
        s.wait(&["late"], Duration::from_secs(5)).unwrap();
        assert_eq!(s.get("late").unwrap(), b"v");
        setter.join().unwrap();
        let start = Instant::now();
        let err = s.get_timeout("never", Duration::from_millis(200)).unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_client_without_the_token_cannot_join() {
        let (server, s) = local();
        let err = Store::connect(server.addr(), "guess", Duration::from_secs(5)).err().unwrap();
        assert!(err.to_string().contains("different job tokens"), "{err}");
        // Raw bytes that are not the protocol do not disturb the store either.
        let mut raw = TcpStream::connect(server.addr()).unwrap();
        raw.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        s.set("still", b"fine").unwrap();
        assert_eq!(s.get("still").unwrap(), b"fine");
    }

    #[test]
    fn hostile_clients_are_dropped_and_the_store_keeps_serving() {
        let (server, s) = local();
        let addr = server.addr();
        // A first frame far over the handshake's limit: closed without reading it.
        let mut big = TcpStream::connect(addr).unwrap();
        big.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        let mut buf = [0u8; 1];
        big.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        assert_eq!(big.read(&mut buf).expect("the server closed it"), 0, "the oversized frame ends the connection");
        // One that stalls mid-handshake holds nobody up, and is closed by the deadline.
        let mut stalled = TcpStream::connect(addr).unwrap();
        stalled.write_all(&[100, 0, 0]).unwrap();
        let other = Store::connect(addr, "secret", Duration::from_secs(5)).unwrap();
        other.set("k", b"v").unwrap();
        // The server closes it (end of stream, not this side's read timeout running out).
        stalled.set_read_timeout(Some(auth::HANDSHAKE_TIME * 6)).unwrap();
        assert_eq!(stalled.read(&mut buf).expect("the server closed the stalled connection"), 0);
        // Authenticated but malformed requests end that connection, not the server: a wait
        // without keys, a check without keys, a get with the longest timeout.
        for parts in [vec![vec![Op::Wait as u8]], vec![vec![Op::Check as u8]], vec![vec![Op::Set as u8]]] {
            let mut raw = TcpStream::connect(addr).unwrap();
            auth::connect(&mut raw, b"secret", b"store", "store").unwrap();
            let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            write_frame(&mut raw, &refs).unwrap();
            let _ = read_frame(&mut raw, MAX_FRAME, Some(Instant::now() + Duration::from_secs(5)));
        }
        let mut raw = TcpStream::connect(addr).unwrap();
        auth::connect(&mut raw, b"secret", b"store", "store").unwrap();
        write_frame(&mut raw, &[&[Op::Get as u8], b"k", &u64::MAX.to_le_bytes()]).unwrap();
        let reply = read_frame(&mut raw, MAX_FRAME, Some(Instant::now() + Duration::from_secs(5))).unwrap();
        assert_eq!(reply, vec![vec![OK], b"v".to_vec()]);
        assert_eq!(s.get("k").unwrap(), b"v");
    }
}
