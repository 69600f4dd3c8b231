//! The `nccl` backend for CUDA tensors: NCCL collectives enqueued on torch's current stream
//! of the tensors' device (so they are ordered with the kernels around them), each
//! returning a [`Work`] that completes when the device passes an event recorded after it.
//! Without CUDA in the build or a visible GPU, making the group reports which is missing.
//!
//! Owns [`NcclGroup`]: sharing the NCCL id through the store, the choice of device and the
//! checks of the tensors it is given. Must not call NCCL or CUDA directly: `strata_ext`'s
//! `nccl` module does, and this file only makes those calls a [`ProcessGroup`].
use super::elementwise::check_reducible;
use super::{check_list, check_rank, GroupSetup, ProcessGroup, ReduceOp, Work};
use crate::{Error, Result};
use std::time::Duration;
use strata_ext::nccl::{unique_id, Collective, Communicator};
use tch::{Device, Tensor};

pub struct NcclGroup {
    /// NCCL takes one call at a time per communicator.
    comm: std::sync::Mutex<Communicator>,
    rank: usize,
    size: usize,
    device: usize,
    timeout: Duration,
}

impl NcclGroup {
    /// Rank 0 makes the NCCL id and shares it through the store. Each rank uses device
    /// `LOCAL_RANK` (modulo the visible devices), as torchrun-launched programs do.
    pub fn connect(setup: &GroupSetup) -> Result<NcclGroup> {
        let devices = tch::Cuda::device_count().max(0) as usize;
        if !strata_ext::cuda::is_built() {
            return Err(Error::Comm(
                "the nccl backend needs CUDA, and this build's libtorch has none (scripts/setup.sh installs one that has)".into(),
            ));
        }
        if devices == 0 {
            return Err(Error::Comm("the nccl backend needs a GPU, and none is visible".into()));
        }
        let local: usize = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(setup.rank);
        let device = local % devices;
        let key = format!("{}nccl/id", setup.prefix);
        let id = if setup.rank == 0 {
            let id = unique_id()?;
            setup.store.set(&key, &id)?;
            id
        } else {
            let bytes = setup.get(&key)?;
            bytes.try_into().map_err(|_| Error::Comm("malformed NCCL id in the store".into()))?
        };
        let comm = Communicator::init(&id, setup.size, setup.rank, device)?;
        Ok(NcclGroup {
            comm: std::sync::Mutex::new(comm),
            rank: setup.rank,
            size: setup.size,
            device,
            timeout: setup.timeout,
        })
    }

    fn check(&self, tensors: &[&Tensor]) -> Result<()> {
        match tensors.iter().find(|t| t.device() != Device::Cuda(self.device)) {
            Some(t) => Err(Error::Comm(format!("nccl group on cuda:{} got a tensor on {:?}", self.device, t.device()))),
            None => Ok(()),
        }
    }

    fn run(&self, what: Collective, tensors: &[&Tensor], op: ReduceOp, peer: usize) -> Result<Work> {
        self.check(tensors)?;
        let op = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
        };
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        Ok(Work::on_device(comm.collective(what, tensors, op, peer)?, self.timeout))
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &str {
        "nccl"
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        check_reducible(t.kind(), op)?;
        self.run(Collective::AllReduce, &[t], op, 0)
    }
    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        check_list(self.size, "all_gather outputs", outputs)?;
        let mut all: Vec<&Tensor> = outputs.iter().collect();
        all.push(input);
        self.run(Collective::AllGather, &all, ReduceOp::Sum, self.rank)
    }
    fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        check_list(self.size, "reduce_scatter inputs", inputs)?;
        check_reducible(output.kind(), op)?;
        let mut all = vec![output];
        all.extend(inputs.iter());
        self.run(Collective::ReduceScatter, &all, op, 0)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Work> {
        check_rank(self.size, "broadcast root", root)?;
        self.run(Collective::Broadcast, &[t], ReduceOp::Sum, root)
    }
    fn reduce(&self, t: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        check_rank(self.size, "reduce root", root)?;
        check_reducible(t.kind(), op)?;
        self.run(Collective::Reduce, &[t], op, root)
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<Work> {
        check_rank(self.size, "send peer", peer)?;
        self.run(Collective::Send, &[t], ReduceOp::Sum, peer)
    }
    fn recv(&self, t: &Tensor, peer: usize) -> Result<Work> {
        check_rank(self.size, "recv peer", peer)?;
        self.run(Collective::Recv, &[t], ReduceOp::Sum, peer)
    }
    fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<Work> {
        check_list(self.size, "all_to_all outputs", outputs)?;
        check_list(self.size, "all_to_all inputs", inputs)?;
        let all: Vec<&Tensor> = outputs.iter().chain(inputs.iter()).collect();
        self.run(Collective::AllToAll, &all, ReduceOp::Sum, 0)
    }
    fn barrier(&self) -> Result<Work> {
        let t = Tensor::zeros([1], (tch::Kind::Float, Device::Cuda(self.device)));
        self.all_reduce(&t, ReduceOp::Sum)
    }
}
