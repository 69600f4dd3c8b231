//! Collectives on GPU tensors through a host backend (`"cuda:shm"`, `"cuda:tcp"`): each
//! tensor is copied into pinned host memory, the host group runs the collective there, and
//! a thread of the group copies the results back before the work completes. This lets
//! several ranks share one GPU, which NCCL refuses, and GPUs without NCCL train together;
//! real multi-GPU runs use `nccl`.
//!
//! The copy to the host happens when the collective is issued and waits for the device to
//! produce the tensor, so an issuing thread does not run ahead of its GPU while staging.
use super::{ProcessGroup, ReduceOp, Work};
use crate::{Error, Result};
use std::sync::mpsc;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// A collective issued on host copies: once `inner` completes, each host tensor is copied
/// into its device tensor, and then `done` completes.
struct Return {
    inner: Work,
    copies: Vec<(Tensor, Tensor)>,
    done: Work,
}

pub(super) struct HostStaged {
    inner: Box<dyn ProcessGroup>,
    timeout: Duration,
    returns: mpsc::Sender<Return>,
}

impl HostStaged {
    pub(super) fn new(inner: Box<dyn ProcessGroup>, timeout: Duration) -> HostStaged {
        let (tx, rx) = mpsc::channel::<Return>();
        // Returns complete in issue order, as the host group completes its collectives; the
        // thread ends when the group is dropped.
        std::thread::spawn(move || {
            for r in rx {
                let result = r.inner.wait().and_then(|()| {
                    for (device, host) in &r.copies {
                        write_back(device, host)?;
                    }
                    Ok(())
                });
                r.done.finish(result);
            }
        });
        HostStaged { inner, timeout, returns: tx }
    }

    /// Runs `issue` on host copies of `inputs` (their values) and `outputs` (written by
    /// the collective, copied back to the device when it completes). Host tensors pass as
    /// they are.
    fn staged(
        &self,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        issue: impl FnOnce(&[Tensor], &[Tensor]) -> Result<Work>,
    ) -> Result<Work> {
        let host_inputs = inputs.iter().map(|t| to_host(t, true)).collect::<Result<Vec<_>>>()?;
        let host_outputs = outputs.iter().map(|t| to_host(t, false)).collect::<Result<Vec<_>>>()?;
        let inner = issue(&host_inputs, &host_outputs)?;
        let copies = outputs.iter().map(|t| t.shallow_clone()).zip(host_outputs).collect();
        self.returned(inner, copies)
    }

    /// A collective whose tensor is read and written in place.
    fn in_place(&self, t: &Tensor, issue: impl FnOnce(&Tensor) -> Result<Work>) -> Result<Work> {
        let host = to_host(t, true)?;
        let inner = issue(&host)?;
        self.returned(inner, vec![(t.shallow_clone(), host)])
    }

    /// `inner`, followed by copying each (device, host) pair's host tensor into the device
    /// one; pairs already on the host need no copy.
    fn returned(&self, inner: Work, mut copies: Vec<(Tensor, Tensor)>) -> Result<Work> {
        copies.retain(|(t, _)| t.device() != Device::Cpu);
        if copies.is_empty() {
            return Ok(inner);
        }
        let done = Work::pending(self.timeout);
        let r = Return { inner, copies, done: done.clone() };
        self.returns.send(r).map_err(|_| Error::Comm("the staging thread of a host-staged group stopped".into()))?;
        Ok(done)
    }
}

/// Writes `host` into `device`'s memory as the host backends write into host memory: through
/// an alias of its storage with a version counter of its own. Gathers refill parameters
/// that autograd saved for backward (fsdp), which a versioned in-place copy would make look
/// modified.
fn write_back(device: &Tensor, host: &Tensor) -> Result<()> {
    let mut alias = Tensor::f_empty([0], (device.kind(), device.device()))?;
    let _ = alias.f_set_source_tensor_(device)?;
    alias.f_copy_(host)?;
    Ok(())
}

/// A pinned host tensor shaped as `t`, holding its values where `copy` (else uninitialised);
/// `t` itself where it already lives on the host.
fn to_host(t: &Tensor, copy: bool) -> Result<Tensor> {
    if t.device() == Device::Cpu {
        return Ok(t.shallow_clone());
    }
    let mut host = Tensor::f_empty(t.size(), (t.kind(), Device::Cpu))?.f_pin_memory(t.device())?;
    if copy {
        host.f_copy_(t)?;
    }
    Ok(host)
}

impl ProcessGroup for HostStaged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> &str {
        self.inner.backend()
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.in_place(t, |h| self.inner.all_reduce(h, op))
    }
    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        let outs: Vec<&Tensor> = outputs.iter().collect();
        self.staged(&[input], &outs, |i, o| self.inner.all_gather(o, &i[0]))
    }
    fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        let ins: Vec<&Tensor> = inputs.iter().collect();
        self.staged(&ins, &[output], |i, o| self.inner.reduce_scatter(&o[0], i, op))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Work> {
        self.in_place(t, |h| self.inner.broadcast(h, root))
    }
    fn reduce(&self, t: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        self.in_place(t, |h| self.inner.reduce(h, root, op))
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<Work> {
        self.staged(&[t], &[], |i, _| self.inner.send(&i[0], peer))
    }
    fn recv(&self, t: &Tensor, peer: usize) -> Result<Work> {
        self.staged(&[], &[t], |_, o| self.inner.recv(&o[0], peer))
    }
    fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<Work> {
        let (outs, ins): (Vec<&Tensor>, Vec<&Tensor>) = (outputs.iter().collect(), inputs.iter().collect());
        self.staged(&ins, &outs, |i, o| self.inner.all_to_all(o, i))
    }
    fn barrier(&self) -> Result<Work> {
        self.inner.barrier()
    }
    fn alloc(&self, numel: i64, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        match device {
            Device::Cpu => self.inner.alloc(numel, kind, device),
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_back_refills_saved_tensors_without_touching_their_version() {
        let flat = Tensor::zeros([6], (Kind::Float, Device::Cpu));
        let weight = flat.narrow(0, 0, 4).view([2, 2]).detach().set_requires_grad(true);
        let x = Tensor::ones([2, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        // The product saves the weight for x's gradient, as a linear layer does.
        let y = x.matmul(&weight).sum(Kind::Float);
        let version = weight.f_internal_version().unwrap();
        write_back(&flat.narrow(0, 0, 4), &Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0])).unwrap();
        assert_eq!(weight.f_internal_version().unwrap(), version);
        assert_eq!(Vec::<f32>::try_from(flat).unwrap(), [1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);
        y.backward();
        // d(sum(x·W))/dx = row sums of W, from the refilled values.
        assert_eq!(Vec::<f32>::try_from(x.grad().view([-1])).unwrap(), [3.0, 7.0, 3.0, 7.0]);
    }
}
