//! `strata fork-server` (hidden): a `strata` process that loads and initializes libtorch
//! once, then forks a copy of itself for each command a client sends over a Unix socket.
//! A harness that runs many short commands (the test suite) so skips libtorch's start-up,
//! about 0.4 s of CPU per command. The copy runs the command as a fresh `strata`
//! process would (the client's arguments, environment, working folder and standard
//! streams) and the client is told how it ended. The server ends by itself when the
//! process that started it ends, or after it has been idle for `--idle` seconds. It says
//! `listening on SOCKET` on its standard output once it takes commands.
//!
//! Protocol, one connection per command: the client writes one line of JSON
//! ([`Request`]); the server answers with one line, the command's wait status as
//! `waitpid` gives it, once the command has ended.
//!
//! Variables a library reads when the process starts (`OMP_NUM_THREADS`,
//! `GLIBC_TUNABLES`, the loader's) took their values when the server started: a client
//! that changes them must start the command as a process of its own.
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct ForkServerArgs {
    /// The Unix socket to listen on (created; its folder should be private).
    #[arg(long)]
    pub socket: PathBuf,
    /// Seconds without a command after which the server ends.
    #[arg(long, default_value_t = 600.0)]
    pub idle: f64,
}

/// One command to run.
#[derive(Serialize, Deserialize, Debug)]
pub struct Request {
    /// The command line, the program first.
    pub args: Vec<String>,
    /// The whole environment of the command.
    pub env: Vec<(String, String)>,
    /// Its working folder.
    pub cwd: PathBuf,
    /// Files its standard output and error are written to (created or truncated); its
    /// standard input is empty.
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

/// How often the server looks whether its parent has ended.
const WATCH: Duration = Duration::from_millis(500);

pub fn serve(a: ForkServerArgs) -> Result<()> {
    let idle = crate::options::seconds("--idle", a.idle, true)?;
    let listener = UnixListener::bind(&a.socket).with_context(|| format!("cannot listen on {}", a.socket.display()))?;
    // One line once commands are taken, for a client to wait on.
    println!("listening on {}", a.socket.display());
    std::io::stdout().flush()?;
    // SAFETY: getppid has no preconditions; SIGCHLD ignored makes the kernel reap the copies.
    let parent = unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
        libc::getppid()
    };
    let mut last = Instant::now();
    loop {
        let mut ready = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut ready, 1, WATCH.as_millis() as i32) };
        // SAFETY: as above.
        if unsafe { libc::getppid() } != parent || last.elapsed() > idle {
            let _ = std::fs::remove_file(&a.socket);
            return Ok(());
        }
        if n <= 0 {
            continue;
        }
        let (connection, _) = listener.accept().context("cannot accept a command")?;
        last = Instant::now();
        // SAFETY: the server is single-threaded (it never starts a thread); the child never
        // returns from `watch_command`.
        match unsafe { libc::fork() } {
            -1 => bail!("cannot fork: {}", std::io::Error::last_os_error()),
            0 => {
                // SAFETY: the child never returns, so the listener is never used or dropped again.
                unsafe { libc::close(listener.as_raw_fd()) };
                watch_command(connection)
            }
            _ => drop(connection),
        }
    }
}

/// A copy of the server that reads one request, forks the process that runs it, waits for
/// that process and answers with how it ended.
fn watch_command(connection: UnixStream) -> ! {
    // SAFETY: waiting for our own child needs SIGCHLD's default disposition back.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
    let mut line = String::new();
    let request =
        BufReader::new(&connection).read_line(&mut line).ok().and_then(|_| serde_json::from_str::<Request>(&line).ok());
    let Some(request) = request else { crate::end_process(2) };
    // SAFETY: this copy is single-threaded; the child never returns from `run_command`.
    let pid = match unsafe { libc::fork() } {
        -1 => crate::end_process(2),
        0 => run_command(request, connection.as_raw_fd()),
        pid => pid,
    };
    let mut status = 0;
    // SAFETY: waits for our own child.
    while unsafe { libc::waitpid(pid, &mut status, 0) } == -1 {
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            crate::end_process(2);
        }
    }
    let _ = (&connection).write_all(format!("{status}\n").as_bytes());
    crate::end_process(0)
}

/// The process that runs the command: its streams, folder and environment as the request
/// says, then `strata` as `main` runs it.
fn run_command(request: Request, connection: i32) -> ! {
    let opened = (|| -> std::io::Result<[std::fs::File; 3]> {
        let input = std::fs::File::open("/dev/null")?;
        let output = std::fs::File::create(&request.stdout)?;
        let error = std::fs::File::create(&request.stderr)?;
        std::env::set_current_dir(&request.cwd)?;
        Ok([input, output, error])
    })();
    let Ok(files) = opened else { crate::end_process(127) };
    // SAFETY: a single-threaded process setting up its own standard streams.
    unsafe {
        for (fd, file) in files.iter().enumerate() {
            libc::dup2(file.as_raw_fd(), fd as i32);
        }
        libc::close(connection);
    }
    drop(files);
    for (key, _) in std::env::vars_os() {
        std::env::remove_var(key);
    }
    for (key, value) in &request.env {
        std::env::set_var(key, value);
    }
    let status = std::panic::catch_unwind(|| crate::start(&request.args)).unwrap_or(101);
    crate::end_process(status)
}
