//! Who may talk to a job: a mutual challenge–response over a fresh TCP connection, keyed by
//! the job's token, for the store and the TCP data mesh alike. The token never crosses the
//! wire: each side proves it holds it with an HMAC-SHA256 over both sides' random nonces,
//! compared in constant time. Before a peer has proven itself it may send only small frames
//! ([`HANDSHAKE_FRAME`]), and the whole handshake must finish by one deadline.
//!
//! Also the frame codec both users share: a `u32` length, then parts, each a `u32` length
//! and its bytes.
use crate::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Largest frame a peer may send before it is authenticated.
pub const HANDSHAKE_FRAME: usize = 4 << 10;
/// Time a peer has to complete the handshake.
pub const HANDSHAKE_TIME: Duration = Duration::from_secs(10);

const MAGIC: &[u8] = b"STRATA-AUTH-1";
const NONCE: usize = 32;
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;

pub fn write_frame(s: &mut TcpStream, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut buf = Vec::new();
    for p in parts {
        buf.extend_from_slice(&(p.len() as u32).to_le_bytes());
        buf.extend_from_slice(p);
    }
    s.write_all(&(buf.len() as u32).to_le_bytes())?;
    s.write_all(&buf)
}

/// Fills `buf`, every read bounded by what is left until `deadline` (none: wait as long
/// as the socket's own timeout says).
fn read_until(s: &mut TcpStream, buf: &mut [u8], deadline: Option<Instant>) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        if let Some(d) = deadline {
            let left = d.checked_duration_since(Instant::now()).filter(|l| !l.is_zero());
            let left = left.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake deadline"))?;
            s.set_read_timeout(Some(left))?;
        }
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one frame of at most `max` bytes, by `deadline` if one is given.
pub fn read_frame(s: &mut TcpStream, max: usize, deadline: Option<Instant>) -> std::io::Result<Vec<Vec<u8>>> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut len = [0u8; 4];
    read_until(s, &mut len, deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(bad("frame too large"));
    }
    let mut buf = vec![0u8; len];
    read_until(s, &mut buf, deadline)?;
    let mut parts = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let head: [u8; 4] =
            buf.get(at..at + 4).and_then(|b| b.try_into().ok()).ok_or_else(|| bad("malformed frame"))?;
        let n = u32::from_le_bytes(head) as usize;
        parts.push(buf.get(at + 4..at + 4 + n).ok_or_else(|| bad("malformed frame"))?.to_vec());
        at += 4 + n;
    }
    Ok(parts)
}

/// `N` bytes from the system's random source.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut n = [0u8; N];
    getrandom::fill(&mut n).map_err(|e| Error::Comm(format!("no random source: {e}")))?;
    Ok(n)
}

fn keyed(token: &[u8], role: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token).unwrap_or_else(|_| unreachable!("any key length"));
    mac.update(role);
    for p in parts {
        mac.update(&(p.len() as u64).to_le_bytes());
        mac.update(p);
    }
    mac
}

fn proof(token: &[u8], role: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    keyed(token, role, parts).finalize().into_bytes().to_vec()
}

/// Constant-time check of `tag` against the proof of `parts`.
fn verify(token: &[u8], role: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    keyed(token, role, parts).verify_slice(tag).is_ok()
}

/// A value only holders of `secret` can compute from `message` (hex of an HMAC-SHA256).
pub fn derive(secret: &[u8], message: &[u8]) -> String {
    proof(secret, b"derive", &[message]).iter().map(|b| format!("{b:02x}")).collect()
}

fn io(peer: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Comm(format!("handshake with {peer}: {e}"))
}

/// The connecting side: proves it holds `token`, checks that the other side does, and
/// hands over `context` (what it claims to be), bound into its proof.
pub fn connect(s: &mut TcpStream, token: &[u8], context: &[u8], peer: &str) -> Result<()> {
    let deadline = Some(Instant::now() + HANDSHAKE_TIME);
    let mine = random_bytes::<NONCE>()?;
    write_frame(s, &[MAGIC, &mine]).map_err(io(peer))?;
    let reply = read_frame(s, HANDSHAKE_FRAME, deadline).map_err(io(peer))?;
    let refused = || Error::Comm(format!("{peer} refused this process: they hold different job tokens"));
    let [theirs, tag] = reply.as_slice() else { return Err(refused()) };
    if !verify(token, b"server", &[&mine, theirs], tag) {
        return Err(refused());
    }
    write_frame(s, &[context, &proof(token, b"client", &[theirs, &mine, context])]).map_err(io(peer))?;
    match read_frame(s, HANDSHAKE_FRAME, deadline).map_err(io(peer))?.first().map(Vec::as_slice) {
        Some([ACCEPTED]) => {
            s.set_read_timeout(None).map_err(io(peer))?;
            Ok(())
        }
        _ => Err(refused()),
    }
}

/// The accepting side: the peer's context once it has proven it holds `token` and `admit`
/// takes what it claims to be (deciding before the peer is told); a peer that fails, is not
/// admitted, stalls past [`HANDSHAKE_TIME`] or sends a large frame is refused.
pub fn accept(s: &mut TcpStream, token: &[u8], admit: impl FnOnce(&[u8]) -> bool) -> Result<Vec<u8>> {
    let deadline = Some(Instant::now() + HANDSHAKE_TIME);
    let failed = |e: std::io::Error| Error::Comm(format!("handshake: {e}"));
    let hello = read_frame(s, HANDSHAKE_FRAME, deadline).map_err(failed)?;
    let [magic, theirs] = hello.as_slice() else { return Err(Error::Comm("handshake: not a Strata peer".into())) };
    if magic != MAGIC {
        return Err(Error::Comm("handshake: not a Strata peer".into()));
    }
    let mine = random_bytes::<NONCE>()?;
    write_frame(s, &[&mine, &proof(token, b"server", &[theirs, &mine])]).map_err(failed)?;
    let answer = read_frame(s, HANDSHAKE_FRAME, deadline).map_err(failed)?;
    let refuse = |s: &mut TcpStream, why: &str| {
        let _ = write_frame(s, &[&[REFUSED]]);
        Err(Error::Comm(format!("handshake: {why}")))
    };
    let [context, tag] = answer.as_slice() else { return refuse(s, "not a Strata peer") };
    if !verify(token, b"client", &[&mine, theirs, context], tag) {
        return refuse(s, "the peer does not hold the job's token");
    }
    if !admit(context) {
        return refuse(s, "the peer is not one this side expects");
    }
    write_frame(s, &[&[ACCEPTED]]).map_err(failed)?;
    s.set_read_timeout(None).map_err(failed)?;
    Ok(context.clone())
}
