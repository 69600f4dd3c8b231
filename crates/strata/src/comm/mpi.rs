//! The `mpi` backend (cargo feature `mpi`), for CPU clusters whose ranks `mpirun` starts:
//! MPI point-to-point under the shared ring algorithms, and MPI's own all-reduce for the
//! element types MPI knows (f32, f64, i32, i64; f16 and bf16 take the ring).
//!
//! MPI's failure model applies: a rank that dies makes `mpirun` end the job, and MPI calls
//! have no timeout of their own.
//!
//! Owns MPI's initialisation and finalisation and [`MpiTransport`]. Must not queue work or
//! touch tensors: the ring group of `algorithms` runs it, as it runs the other transports.
use super::elementwise::divide;
use super::transport::Transport;
use super::{GroupSetup, ReduceOp};
use crate::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, Group, SimpleCommunicator};
use mpi::traits::*;
use std::sync::{Mutex, OnceLock};
use tch::Kind;

/// MPI, initialised once per process with full thread support (collectives run on each
/// group's own thread). Finalised when the process exits.
struct Universe(mpi::environment::Universe);

// SAFETY: initialised with MPI_THREAD_MULTIPLE, so MPI may be called from any thread.
unsafe impl Send for Universe {}
unsafe impl Sync for Universe {}

/// Finalises MPI where this process initialised it and has not finalised it yet.
pub(super) extern "C" fn finalize_at_exit() {
    // SAFETY: plain MPI queries and finalisation, at process exit, after all groups.
    unsafe {
        let (mut init, mut fin) = (0, 0);
        mpi::ffi::MPI_Initialized(&mut init);
        mpi::ffi::MPI_Finalized(&mut fin);
        if init != 0 && fin == 0 {
            mpi::ffi::MPI_Finalize();
        }
    }
}

fn universe() -> Result<&'static Universe> {
    static UNIVERSE: OnceLock<Mutex<Option<&'static Universe>>> = OnceLock::new();
    let mut slot = UNIVERSE.get_or_init(|| Mutex::new(None)).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(u) = *slot {
        return Ok(u);
    }
    let (u, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .ok_or_else(|| Error::Comm("MPI was already initialised outside Strata".into()))?;
    if threading != mpi::Threading::Multiple {
        return Err(Error::Comm(format!(
            "the MPI library offers {threading:?} threading; the mpi backend needs Multiple"
        )));
    }
    // SAFETY: registers a plain function to run at exit.
    unsafe { libc::atexit(finalize_at_exit) };
    // The universe lives as long as the process; finalisation happens at exit instead.
    let u: &'static Universe = Box::leak(Box::new(Universe(u)));
    *slot = Some(u);
    Ok(u)
}

pub struct MpiTransport {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
}

// SAFETY: MPI runs with MPI_THREAD_MULTIPLE; the communicator is used by one thread at a time.
unsafe impl Send for MpiTransport {}

impl MpiTransport {
    /// A communicator of the group's global ranks, made by the group's members alone.
    pub fn connect(setup: &GroupSetup) -> Result<MpiTransport> {
        let world = universe()?.0.world();
        if world.size() as usize != setup.world_size {
            return Err(Error::Comm(format!(
                "MPI sees {} processes but the job has {}: start the ranks with mpirun to use the mpi backend",
                world.size(),
                setup.world_size
            )));
        }
        let ranks: Vec<i32> = setup.ranks.iter().map(|&r| r as i32).collect();
        let group = world.group().include(&ranks);
        let comm = world.split_by_subgroup(&group).ok_or_else(|| Error::Comm("MPI did not create the group".into()))?;
        if comm.rank() as usize != setup.rank || comm.size() as usize != setup.size {
            return Err(Error::Comm("MPI ranks do not match the job's ranks".into()));
        }
        Ok(MpiTransport { comm, rank: setup.rank, size: setup.size })
    }
}

fn native<T: Equivalence + Copy>(comm: &SimpleCommunicator, buf: &mut [u8], op: &SystemOperation) {
    let n = buf.len() / std::mem::size_of::<T>();
    if n == 0 {
        return;
    }
    // SAFETY: tensor storage aligned for T holding n elements.
    let data = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut T, n) };
    let input = data.to_vec();
    comm.all_reduce_into(&input[..], data, op);
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, to: usize, out: &[u8], from: usize, inp: &mut [u8]) -> Result<()> {
        let (dst, src) = (self.comm.process_at_rank(to as i32), self.comm.process_at_rank(from as i32));
        match (out.is_empty(), inp.is_empty()) {
            (true, true) => {}
            (false, true) => dst.send(out),
            (true, false) => {
                src.receive_into(inp);
            }
            (false, false) => mpi::request::scope(|scope| {
                let sending = dst.immediate_send(scope, out);
                src.receive_into(inp);
                sending.wait();
            }),
        }
        Ok(())
    }

    fn native_all_reduce(&mut self, buf: &mut [u8], kind: Kind, op: ReduceOp) -> Option<Result<()>> {
        let system = match op {
            ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
        };
        match kind {
            Kind::Float => native::<f32>(&self.comm, buf, &system),
            Kind::Double => native::<f64>(&self.comm, buf, &system),
            Kind::Int => native::<i32>(&self.comm, buf, &system),
            Kind::Int64 => native::<i64>(&self.comm, buf, &system),
            _ => return None,
        }
        if op == ReduceOp::Avg {
            divide(kind, buf, self.size);
        }
        Some(Ok(()))
    }
}
