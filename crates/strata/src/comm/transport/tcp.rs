//! The TCP transport: a full mesh of authenticated connections between the ranks, for
//! groups that span hosts.
use super::{peer_error, Transport};
use crate::comm::{auth, GroupSetup};
use crate::{Error, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Mesh handshakes running at once; later connections wait in the listen backlog.
const MAX_HANDSHAKES: usize = 64;

/// A full mesh of TCP connections. Sends run on a scoped thread while the caller receives,
/// so two ranks sending to each other never wait on each other's buffers.
pub struct TcpTransport {
    rank: usize,
    size: usize,
    readers: Vec<Option<TcpStream>>,
    writers: Vec<Option<TcpStream>>,
}

impl TcpTransport {
    /// Listens on the interface that reaches the store, publishes the address, connects to
    /// lower ranks and accepts higher ones. Every connection is authenticated with the
    /// job's token and names its group and rank; a connection that fails is dropped and the
    /// mesh keeps accepting until every expected rank has joined or the timeout passes.
    pub fn connect(setup: &GroupSetup) -> Result<TcpTransport> {
        let (rank, size) = (setup.rank, setup.size);
        let ip = setup.store.local_ip()?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::Comm(format!("cannot listen on {ip}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::Comm(e.to_string()))?;
        setup.store.set(&format!("{}tcp/{rank}", setup.prefix), addr.to_string().as_bytes())?;
        let token = setup.store.token();
        let context = |r: usize| [setup.prefix.as_bytes(), &(r as u64).to_le_bytes()].concat();
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let io = |peer: usize| move |e: std::io::Error| peer_error(peer, format!("connection failed: {e}"));
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let text = String::from_utf8_lossy(&setup.get(&format!("{}tcp/{peer}", setup.prefix))?).into_owned();
            let peer_addr: SocketAddr = text.parse().map_err(|_| peer_error(peer, format!("bad address {text:?}")))?;
            let mut s = TcpStream::connect_timeout(&peer_addr, setup.timeout).map_err(io(peer))?;
            auth::connect(&mut s, token, &context(rank), &format!("rank {peer}"))?;
            *slot = Some(s);
        }
        listener.set_nonblocking(true).map_err(|e| Error::Comm(e.to_string()))?;
        let deadline = Instant::now() + setup.timeout;
        // Handshakes run on threads of their own, so a peer that stalls holds up no other;
        // a slot is claimed when a peer proves who it is, before it is told it may join.
        let claimed: Arc<Mutex<Vec<bool>>> = Arc::new(Mutex::new(vec![false; size]));
        let expected: Vec<(usize, Vec<u8>)> = (rank + 1..size).map(|p| (p, context(p))).collect();
        let (joined, arrivals) = std::sync::mpsc::channel();
        let mut in_flight = 0usize;
        let mut looks = setup.given_up_looks();
        while streams.iter().skip(rank + 1).any(Option::is_none) {
            while let Ok(arrival) = arrivals.try_recv() {
                in_flight -= 1;
                if let Some((peer, s)) = arrival {
                    streams[peer] = Some(s);
                }
            }
            if streams.iter().skip(rank + 1).all(Option::is_some) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Comm(format!(
                    "rank {rank}: higher ranks did not connect within {:?}",
                    setup.timeout
                )));
            }
            // A peer that never comes because the job gave up on this group's work.
            looks.look(now)?;
            if in_flight >= MAX_HANDSHAKES {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            let mut s = match listener.accept() {
                Ok((s, _)) => s,
                // Nothing yet, or a transient failure (out of descriptors): wait and retry.
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
            };
            let (token, joined, claimed, expected) =
                (token.to_vec(), joined.clone(), claimed.clone(), expected.clone());
            let handshake = move || {
                let mut peer = None;
                let admit = |claim: &[u8]| {
                    let mut slots = claimed.lock().unwrap_or_else(|e| e.into_inner());
                    peer = expected.iter().find(|(p, c)| c == claim && !slots[*p]).map(|(p, _)| *p);
                    peer.inspect(|&p| slots[p] = true).is_some()
                };
                let admitted = s.set_nonblocking(false).is_ok() && auth::accept(&mut s, &token, admit).is_ok();
                if !admitted {
                    tracing::warn!("refused a mesh connection that did not authenticate as an expected peer");
                }
                let _ = joined.send(peer.filter(|_| admitted).map(|p| (p, s)));
            };
            match std::thread::Builder::new().name("strata-mesh-handshake".into()).spawn(handshake) {
                Ok(_) => in_flight += 1,
                Err(e) => tracing::warn!(rank, "cannot start a handshake thread ({e}); the connection is dropped"),
            }
        }
        let mut readers = Vec::with_capacity(size);
        let mut writers = Vec::with_capacity(size);
        for (peer, s) in streams.into_iter().enumerate() {
            match s {
                Some(s) => {
                    s.set_nodelay(true).map_err(io(peer))?;
                    s.set_read_timeout(Some(setup.timeout)).map_err(io(peer))?;
                    s.set_write_timeout(Some(setup.timeout)).map_err(io(peer))?;
                    writers.push(Some(s.try_clone().map_err(io(peer))?));
                    readers.push(Some(s));
                }
                None => {
                    readers.push(None);
                    writers.push(None);
                }
            }
        }
        Ok(TcpTransport { rank, size, readers, writers })
    }

    fn stream(streams: &mut [Option<TcpStream>], peer: usize) -> Result<&mut TcpStream> {
        streams.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| peer_error(peer, "no connection to this rank"))
    }
}

fn io_failure(peer: usize, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => peer_error(peer, "timed out"),
        std::io::ErrorKind::UnexpectedEof => peer_error(peer, "closed the connection (the process exited?)"),
        _ => peer_error(peer, format!("connection lost ({e})")),
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, to: usize, out: &[u8], from: usize, inp: &mut [u8]) -> Result<()> {
        let writer = if out.is_empty() { None } else { Some(Self::stream(&mut self.writers, to)?) };
        let reader = if inp.is_empty() { None } else { Some(Self::stream(&mut self.readers, from)?) };
        std::thread::scope(|scope| {
            let sending = writer.map(|w| scope.spawn(move || w.write_all(out).map_err(|e| io_failure(to, e))));
            let received = reader.map_or(Ok(()), |r| r.read_exact(inp).map_err(|e| io_failure(from, e)));
            let sent =
                sending.map_or(Ok(()), |h| h.join().unwrap_or_else(|_| Err(peer_error(to, "send thread panicked"))));
            received.and(sent)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Store, StoreServer};
    use std::sync::Arc;

    fn setup(store: Store, rank: usize) -> GroupSetup {
        GroupSetup {
            store: Arc::new(store),
            prefix: "mesh-test/".into(),
            rank,
            size: 2,
            ranks: vec![0, 1],
            world_size: 2,
            timeout: Duration::from_secs(30),
            given_up: None,
        }
    }

    #[test]
    fn the_mesh_refuses_a_peer_without_the_token_and_the_job_proceeds() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "job-token").unwrap();
        let addr = server.addr();
        let connect = move || Store::connect(addr, "job-token", Duration::from_secs(10)).unwrap();
        let rank0 = std::thread::spawn(move || TcpTransport::connect(&setup(connect(), 0)));
        // An intruder learns rank 0's address (it is no secret) and claims to be rank 1, with
        // a guessed token, then one that stalls, before the real rank 1 arrives.
        let watcher = connect();
        let listen: SocketAddr = String::from_utf8(watcher.get("mesh-test/tcp/0").unwrap()).unwrap().parse().unwrap();
        let mut intruder = TcpStream::connect(listen).unwrap();
        let claim = [&b"mesh-test/"[..], &1u64.to_le_bytes()].concat();
        let refused = auth::connect(&mut intruder, b"guess", &claim, "rank 0").unwrap_err();
        assert!(refused.to_string().contains("token"), "{refused}");
        let mut staller = TcpStream::connect(listen).unwrap();
        staller.write_all(&[200, 0]).unwrap();
        let mut rank1 = TcpTransport::connect(&setup(connect(), 1)).unwrap();
        let mut rank0 = rank0.join().unwrap().unwrap();
        let sender = std::thread::spawn(move || rank1.send(0, b"hello").map(|_| rank1));
        let mut got = [0u8; 5];
        rank0.recv(1, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        sender.join().unwrap().unwrap();
    }
}
