//! `strata launch`: starts the ranks of one node as torchrun does, prefixes their output
//! with the rank, and when one fails stops the others and names it, then starts them all
//! again while restarts remain (`--max-restarts`). It owns the node's folder of checkpoint
//! snapshots in host memory (`STRATA_SNAPSHOT_DIR`): it outlives every round of ranks, so
//! restarted ranks resume from memory, and goes when the launcher ends.
//!
//! A rank that runs this same binary is a fork of the launcher that runs its command in
//! place, when the launcher may fork safely (see [`can_fork_in_place`]): it skips loading
//! and initializing libtorch again, about 0.4 s of CPU per rank. Any other command runs
//! as a fresh process.
use anyhow::{bail, Context, Result};
use clap::Args;
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index (0 hosts the rendezvous store through its rank 0).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, where rank 0 serves the store.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the store (default: a free port on one node, 29500 across nodes).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Show only this rank's standard output, without the rank prefix, so a report it
    /// prints (`--json`) stays machine-readable; every rank's standard error is still shown.
    #[arg(long)]
    pub stdout_of: Option<usize>,
    /// Seconds the other ranks get to exit after a failure before they are killed.
    #[arg(long, default_value_t = 5.0)]
    pub grace: f64,
    /// Times the ranks are all started again after one fails (one node).
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// The command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// How long the other ranks may take to end by themselves after one fails, before they are
/// stopped.
const SETTLE: Duration = Duration::from_secs(2);

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}

/// A port on `addr` free now, for rank 0's store. Rank 0 binds it only later, so it is
/// drawn below the range the kernel hands out to outgoing connections
/// (`ip_local_port_range`): a connection made meanwhile, by these ranks or anyone, cannot
/// take it. Where that range leaves no room below it, any free port.
fn free_port(addr: &str) -> Result<u16> {
    let outgoing_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FIRST: u16 = 10_000;
    // Random draws, so that launches starting together rarely try the same port.
    let mut draws = [0u8; 128];
    let drawn = getrandom::fill(&mut draws).is_ok();
    if drawn && outgoing_low > FIRST {
        for pair in draws.chunks_exact(2) {
            let port = FIRST + u16::from_le_bytes([pair[0], pair[1]]) % (outgoing_low - FIRST);
            if std::net::TcpListener::bind((addr, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let l = std::net::TcpListener::bind((addr, 0)).with_context(|| format!("cannot find a free port on {addr}"))?;
    Ok(l.local_addr()?.port())
}

/// Lines of the ranks' standard error that are errors (`[rank R] error: ...`), kept apart
/// instead of shown, where the caller says them its own way.
type Errors = Arc<Mutex<Vec<String>>>;

/// Where a rank's stream goes.
#[derive(Clone)]
enum Relay {
    Prefixed {
        to_stderr: bool,
    },
    /// Prefixed to our standard error, but errors into the list.
    ErrorsApart(Errors),
    /// Unprefixed to our standard output.
    Raw,
    /// Read and dropped, so the rank never blocks on a full pipe.
    Dropped,
}

/// Copies one child's stream to ours, a line at a time, each line prefixed with its rank
/// unless `how` says otherwise.
fn relay(source: impl Read + Send + 'static, rank: usize, how: Relay) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut lines = BufReader::new(source);
        let mut line = Vec::new();
        while matches!(lines.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end_matches('\n');
            // One write per line keeps lines of different ranks whole.
            let _ = match &how {
                Relay::ErrorsApart(errors) if text.starts_with("error: ") => {
                    errors.lock().unwrap_or_else(|p| p.into_inner()).push(format!("[rank {rank}] {text}"));
                    Ok(())
                }
                Relay::Prefixed { to_stderr: true } | Relay::ErrorsApart(_) => {
                    std::io::stderr().write_all(format!("[rank {rank}] {text}\n").as_bytes())
                }
                Relay::Prefixed { to_stderr: false } => {
                    std::io::stdout().write_all(format!("[rank {rank}] {text}\n").as_bytes())
                }
                Relay::Raw => std::io::stdout().write_all(format!("{text}\n").as_bytes()),
                Relay::Dropped => Ok(()),
            };
            line.clear();
        }
    })
}

/// One started rank: its process, which leads a process group of its own, and how it
/// ended once reaped.
struct RankProcess {
    rank: usize,
    pid: libc::pid_t,
    ended: Option<ExitStatus>,
}

impl RankProcess {
    /// How the rank ended, or `None` while it runs.
    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.ended.is_none() {
            let mut status = 0;
            // SAFETY: waits, without blocking, for our own child.
            match unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) } {
                0 => {}
                -1 => return Err(std::io::Error::last_os_error()).context("cannot wait for a rank"),
                _ => self.ended = Some(ExitStatus::from_raw(status)),
            }
        }
        Ok(self.ended)
    }

    fn running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Waits until the rank has ended.
    fn wait(&mut self) {
        while self.ended.is_none() {
            let mut status = 0;
            // SAFETY: waits for our own child.
            match unsafe { libc::waitpid(self.pid, &mut status, 0) } {
                -1 if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
                -1 => return,
                _ => self.ended = Some(ExitStatus::from_raw(status)),
            }
        }
    }

    /// Signals the rank's whole process group, so whatever the rank started goes too and
    /// no pipe stays open behind it.
    fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to the process group our own child leads.
        unsafe { libc::kill(-self.pid, sig) };
    }
}

/// Whether a rank running `program` may be a fork of this process that runs the command
/// in place, instead of a fresh process: `program` must be this binary, and this process
/// single-threaded (a fork copies the calling thread alone, so a lock another thread held
/// would stay held in the child) without a GPU driver loaded (CUDA cannot be used in a
/// process forked after its driver started).
fn can_fork_in_place(program: &str) -> bool {
    let this = std::env::current_exe().and_then(std::fs::canonicalize);
    let same = matches!((std::fs::canonicalize(program), this), (Ok(a), Ok(b)) if a == b);
    let single_threaded = std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| tasks.count() == 1);
    same && single_threaded && !crate::gpu_driver_loaded()
}

/// A pipe whose ends close on exec: the end to read, the end to write.
fn pipe() -> Result<(File, OwnedFd)> {
    let mut fds: [RawFd; 2] = [0; 2];
    // SAFETY: pipe2 fills `fds` with two new descriptors on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("cannot create a pipe for a rank");
    }
    // SAFETY: both descriptors are new and owned by nothing else.
    Ok(unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Starts `command` with the variables `env` added, in a process group of its own, its
/// standard output and error piped to us: as a fork of this process when `in_place`
/// ([`can_fork_in_place`]), closing there the descriptors in `ours` (the other ranks'
/// pipes), otherwise as a fresh process. The rank, and the pipes' ends to read its
/// standard output and error from.
fn start_rank(
    rank: usize,
    command: &[String],
    env: &[(&str, OsString)],
    in_place: bool,
    ours: &[RawFd],
) -> Result<(RankProcess, File, File)> {
    let (program, args) = command.split_first().context("no command to launch")?;
    if !in_place {
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .with_context(|| format!("cannot start {program:?} for rank {rank}"))?;
        let out = child.stdout.take().context("a rank's standard output is not piped")?;
        let err = child.stderr.take().context("a rank's standard error is not piped")?;
        let process = RankProcess { rank, pid: child.id() as libc::pid_t, ended: None };
        tracing::debug!(rank, pid = process.pid, "rank started as a fresh process");
        return Ok((process, File::from(OwnedFd::from(out)), File::from(OwnedFd::from(err))));
    }
    let (out, out_end) = pipe()?;
    let (err, err_end) = pipe()?;
    // What we buffered would otherwise be written twice, by us and by the child.
    let _ = std::io::stdout().flush();
    // SAFETY: this process is single-threaded (`can_fork_in_place`); the child never returns
    // from `run_forked_rank`.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()).with_context(|| format!("cannot start rank {rank}")),
        0 => {
            let close: Vec<RawFd> =
                [out.as_raw_fd(), err.as_raw_fd()].into_iter().chain(ours.iter().copied()).collect();
            run_forked_rank(command, env, out_end.as_raw_fd(), err_end.as_raw_fd(), &close)
        }
        pid => {
            // Both sides set the group, so that it exists before either goes on.
            // SAFETY: `pid` is our child, not yet past an exec.
            unsafe { libc::setpgid(pid, pid) };
            tracing::debug!(rank, pid, "rank started as a fork of the launcher");
            Ok((RankProcess { rank, pid, ended: None }, out, err))
        }
    }
}

/// The forked rank: its standard output and error into `out` and `err`, a process group
/// of its own, the signal dispositions a fresh process has, the launcher's descriptors in
/// `close` closed and `env` added; then the command, and an exit with its status. It
/// never returns into the launcher's frames (and so never drops what they hold).
fn run_forked_rank(command: &[String], env: &[(&str, OsString)], out: RawFd, err: RawFd, close: &[RawFd]) -> ! {
    // SAFETY: a single-threaded child setting up its own group, signals and descriptors.
    unsafe {
        libc::setpgid(0, 0);
        libc::signal(libc::SIGINT, libc::SIG_DFL);
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
        libc::dup2(out, libc::STDOUT_FILENO);
        libc::dup2(err, libc::STDERR_FILENO);
        for &fd in close.iter().chain([out, err].iter()) {
            libc::close(fd);
        }
    }
    for (key, value) in env {
        std::env::set_var(key, value);
    }
    let status = std::panic::catch_unwind(|| crate::run_in_forked_process(command)).unwrap_or(101);
    crate::end_process(status)
}

/// A SIGINT or SIGTERM sent to the launcher, to be passed on to the ranks.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn remember(sig: i32) {
    RECEIVED.store(sig, Ordering::SeqCst);
}

pub fn run(a: LaunchArgs) -> Result<()> {
    launch(a, None)
}

/// The node's folder of checkpoint snapshots in host memory, private to the user, removed
/// when the launcher ends however it ends (short of being killed).
struct SnapshotDir(PathBuf);

impl SnapshotDir {
    fn create() -> Result<SnapshotDir> {
        let base = strata::checkpoint::snapshot::snapshot_base();
        // SAFETY: getuid has no preconditions.
        let dir = base.join(format!("strata-launch-{}-{}", unsafe { libc::getuid() }, std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("cannot create the snapshot folder {}", dir.display()))?;
        Ok(SnapshotDir(dir))
    }
}

impl Drop for SnapshotDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How a round of ranks ended.
enum Round {
    Done,
    Failed(usize, ExitStatus),
    Interrupted(i32),
}

/// Starts the ranks `a` describes and waits for them, starting them all again after a
/// failure while restarts remain; with `errors`, the ranks' error lines go there instead
/// of to our standard error.
fn launch(a: LaunchArgs, errors: Option<Errors>) -> Result<()> {
    if a.nproc_per_node == 0 || a.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be positive");
    }
    if a.node_rank >= a.nnodes {
        bail!("--node-rank {} is outside {} nodes", a.node_rank, a.nnodes);
    }
    if a.max_restarts > 0 && a.nnodes > 1 {
        bail!("--max-restarts restarts one node's ranks; the nodes of a larger job restart together under torchrun");
    }
    a.nproc_per_node.checked_mul(a.nnodes).context("--nproc-per-node × --nnodes is too many ranks")?;
    let grace = crate::options::seconds("--grace", a.grace, false)?;
    let token = match std::env::var("STRATA_STORE_TOKEN") {
        Ok(t) => t,
        Err(_) if a.nnodes == 1 => strata::comm::store::random_token()?,
        Err(_) => bail!("with several nodes, set STRATA_STORE_TOKEN to the same secret on every node"),
    };
    let snapshots = SnapshotDir::create()?;
    // The ranks have process groups of their own, so a Ctrl-C reaches only us: pass it on.
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, remember as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, remember as *const () as libc::sighandler_t);
    }
    let mut restarts = 0;
    loop {
        // A fresh port each round: the last round's store may still hold its own.
        let port = match a.master_port {
            Some(p) => p,
            None if a.nnodes == 1 => free_port(&a.master_addr)?,
            None => 29500,
        };
        match round(&a, port, &token, &snapshots.0, grace, errors.clone())? {
            Round::Done => return Ok(()),
            Round::Failed(rank, status) if restarts < a.max_restarts => {
                restarts += 1;
                eprintln!(
                    "strata launch: rank {rank} {}; starting the ranks again (restart {restarts} of {})",
                    describe(status),
                    a.max_restarts
                );
            }
            Round::Failed(rank, status) => bail!("rank {rank} {}; the other ranks were stopped", describe(status)),
            Round::Interrupted(sig) => bail!("stopped by signal {sig}; the ranks were stopped"),
        }
    }
}

/// Starts one round of the ranks and waits until all end, one fails (the others are then
/// stopped) or the launcher is interrupted.
fn round(
    a: &LaunchArgs,
    port: u16,
    token: &str,
    snapshots: &Path,
    grace: Duration,
    errors: Option<Errors>,
) -> Result<Round> {
    let world = a.nproc_per_node * a.nnodes;
    // Every rank is started before the relays' threads are, so that the process is still
    // single-threaded at each fork.
    let in_place = a.command.first().is_some_and(|program| can_fork_in_place(program));
    let mut children: Vec<RankProcess> = Vec::new();
    let mut pipes: Vec<(File, File)> = Vec::new();
    for local in 0..a.nproc_per_node {
        let rank = a.node_rank * a.nproc_per_node + local;
        let env: [(&str, OsString); 9] = [
            ("RANK", rank.to_string().into()),
            ("WORLD_SIZE", world.to_string().into()),
            ("LOCAL_RANK", local.to_string().into()),
            ("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string().into()),
            ("GROUP_RANK", a.node_rank.to_string().into()),
            ("MASTER_ADDR", a.master_addr.clone().into()),
            ("MASTER_PORT", port.to_string().into()),
            ("STRATA_STORE_TOKEN", token.into()),
            ("STRATA_SNAPSHOT_DIR", snapshots.into()),
        ];
        let ours: Vec<RawFd> = pipes.iter().flat_map(|(out, err)| [out.as_raw_fd(), err.as_raw_fd()]).collect();
        match start_rank(rank, &a.command, &env, in_place, &ours) {
            Ok((process, out, err)) => {
                children.push(process);
                pipes.push((out, err));
            }
            Err(e) => {
                children.iter().for_each(|c| c.signal(libc::SIGKILL));
                children.iter_mut().for_each(RankProcess::wait);
                return Err(e);
            }
        }
    }
    let mut relays = Vec::new();
    for (child, (out, err)) in children.iter().zip(pipes) {
        let how = match a.stdout_of {
            None => Relay::Prefixed { to_stderr: false },
            Some(r) if r == child.rank => Relay::Raw,
            Some(_) => Relay::Dropped,
        };
        relays.push(relay(out, child.rank, how));
        let how = match &errors {
            Some(list) => Relay::ErrorsApart(Arc::clone(list)),
            None => Relay::Prefixed { to_stderr: true },
        };
        relays.push(relay(err, child.rank, how));
    }
    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut running = children.len();
    while running > 0 && failure.is_none() {
        if RECEIVED.load(Ordering::SeqCst) != 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        running = 0;
        let mut failed = Vec::new();
        for child in &mut children {
            match child.try_wait()? {
                Some(status) if !status.success() => failed.push((child.rank, status)),
                Some(_) => {}
                None => running += 1,
            }
        }
        // Of ranks found failed together, one killed by a signal is named first: it cannot
        // have ended in answer to another's end, while a rank whose peer died exits with an
        // error within moments.
        failure = failed.iter().find(|(_, status)| status.signal().is_some()).or(failed.first()).copied();
    }
    let interrupted = RECEIVED.load(Ordering::SeqCst);
    if failure.is_some() && interrupted == 0 {
        // Ranks that fail alike (a file none can read) fail within moments of each other:
        // give them a moment to say so themselves before stopping them.
        let settle = Instant::now() + SETTLE;
        while Instant::now() < settle && children.iter_mut().any(RankProcess::running) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if failure.is_some() || interrupted != 0 {
        // Ask the others to stop, then make sure they do.
        children.iter().for_each(|c| c.signal(libc::SIGTERM));
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && children.iter_mut().any(RankProcess::running) {
            std::thread::sleep(Duration::from_millis(20));
        }
        children.iter().for_each(|c| c.signal(libc::SIGKILL));
        children.iter_mut().for_each(RankProcess::wait);
    }
    relays.into_iter().for_each(|r| {
        let _ = r.join();
    });
    Ok(match (interrupted, failure) {
        (0, Some((rank, status))) => Round::Failed(rank, status),
        (0, None) => Round::Done,
        (sig, _) => Round::Interrupted(sig),
    })
}

/// Runs this process's command line, `command_line`, again as `n` local ranks started from
/// this process (as `strata launch` starts them), leaving out the option `flag` (and its
/// value) that asked for it; with `stdout_of`, only that rank's standard output is shown,
/// as it printed it. Ranks that all fail alike (a file none can read) give one error, said
/// once.
pub fn relaunch_self(command_line: &[OsString], n: usize, flag: &str, stdout_of: Option<usize>) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the strata binary")?;
    let mut command = vec![exe.to_string_lossy().into_owned()];
    let mut skip = false;
    for arg in command_line.iter().skip(1) {
        let arg = arg.to_str().with_context(|| format!("the argument {arg:?} is not UTF-8"))?;
        if std::mem::take(&mut skip) {
            continue;
        }
        if arg == flag {
            skip = true;
        } else if !arg.starts_with(&format!("{flag}=")) {
            command.push(arg.to_string());
        }
    }
    let args = LaunchArgs {
        nproc_per_node: n,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        stdout_of,
        grace: 5.0,
        max_restarts: 0,
        command,
    };
    let errors: Errors = Arc::default();
    let result = launch(args, Some(Arc::clone(&errors)));
    let errors = std::mem::take(&mut *errors.lock().unwrap_or_else(|p| p.into_inner()));
    let said: Vec<&str> = errors
        .iter()
        .filter_map(|l| l.strip_prefix("[rank ").and_then(|l| l.split_once("] error: ")).map(|(_, t)| t))
        .collect();
    // Every rank said it, and the same: one error. A rank that died without a word (killed)
    // leaves the launcher's word about it and every rank's in place.
    let shared = !said.is_empty() && said.len() == n && said.iter().all(|t| *t == said[0]);
    match (result, shared) {
        (Err(_), true) => bail!("{}", said[0]),
        (result, _) => {
            errors.iter().for_each(|l| eprintln!("{l}"));
            result.map_err(|e| anyhow::anyhow!("{e:#}\nerror: the ranks failed (see their output above)"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::free_port;

    #[test]
    fn the_store_port_lies_below_the_ports_of_outgoing_connections() {
        let Ok(range) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range") else {
            eprintln!("skipped: this system does not say which ports outgoing connections take");
            return;
        };
        let low: u16 = range.split_whitespace().next().unwrap().parse().unwrap();
        if low <= 10_000 {
            eprintln!("skipped: outgoing connections take ports from {low}, leaving none below for the store");
            return;
        }
        for _ in 0..20 {
            let port = free_port("127.0.0.1").unwrap();
            assert!((10_000..low).contains(&port), "port {port}, outgoing connections from {low}");
        }
    }
}
