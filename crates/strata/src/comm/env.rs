//! A rank's identity from its environment: `strata launch` and torchrun (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), Slurm
//! (`SLURM_PROCID`, ...) or Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, ...).
use super::{Comm, Store, StoreServer};
use crate::{Error, Result};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// This rank's place in the job, and where the job's ranks meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// This rank's index among all ranks.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// This rank's index among the ranks of its host (`rank` when unset).
    pub local_rank: usize,
    /// Ranks on this rank's host.
    pub local_world_size: usize,
    /// Host of the store the ranks meet at (`MASTER_ADDR`; under Slurm the step's first node).
    pub master_addr: String,
    /// Port of the store (`MASTER_PORT`, default 29500).
    pub master_port: u16,
    /// Whose store the job meets at, and how it is trusted.
    pub rendezvous: Rendezvous,
}

/// Whose store the job meets at, and how it is trusted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// Strata's store, hosted by rank 0, admitting only holders of `token`.
    Strata {
        /// The job's secret: `STRATA_STORE_TOKEN`, or derived from a Slurm or Open MPI job id.
        token: String,
    },
    /// torchrun's c10d store (torchrun's trust model: no token): hosted by its agent, or by
    /// rank 0 when the agent says it keeps none (`TORCHELASTIC_USE_AGENT_STORE`). Keys live
    /// under the run id and a name the round's ranks agree on in the store
    /// ([`Store::connect_c10d`]), so a restarted round never reads the keys of the round
    /// before it.
    Torchrun {
        /// torchrun's run id (`TORCHELASTIC_RUN_ID`).
        run_id: String,
        /// The agent hosts the store (`TORCHELASTIC_USE_AGENT_STORE`, true when unset).
        agent_store: bool,
    },
}

/// Each launcher's names for (rank, world size, local rank, local world size).
const SCHEMES: [[&str; 4]; 3] = [
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"],
    ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"],
];

/// The number of ranks a launcher (torchrun, `strata launch`, Slurm, Open MPI) started this
/// process among, if one did; nothing else is read or made.
pub fn launched_world_size() -> Option<usize> {
    let names = SCHEMES.iter().find(|s| std::env::var_os(s[0]).is_some())?;
    std::env::var(names[1]).ok()?.trim().parse().ok()
}

/// The tasks on node `node` of a Slurm job step from its tasks-per-node list, nodes in
/// order, a count repeated `k` times written `count(xk)`: `2(x3),1` puts 2 tasks on each of
/// nodes 0–2 and 1 on node 3. `None` where the list is malformed or ends before the node.
fn slurm_tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut first = 0usize;
    for group in list.trim().split(',') {
        let (count, repeat) = match group.split_once("(x") {
            Some((count, rest)) => (count, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (group, 1),
        };
        let count = count.parse::<usize>().ok()?;
        first = first.checked_add(repeat)?;
        if node < first {
            return Some(count);
        }
    }
    None
}

impl RankInfo {
    /// This rank's device when the run asks for `device`, and the backends of its
    /// collectives. On GPUs each local rank takes GPU `local_rank % gpus`, as torchrun
    /// scripts do. Shared memory between the ranks of one host, TCP when the job spans
    /// hosts; GPU tensors over NCCL where each rank has a GPU of its own, else (ranks sharing
    /// a GPU, which NCCL refuses) through the host backend.
    pub fn placement(&self, device: tch::Device, gpus: usize) -> (tch::Device, String) {
        let host = if self.local_world_size == self.world_size { "shm" } else { "tcp" };
        match device {
            tch::Device::Cuda(_) if gpus > 0 => {
                let gpu = if self.local_world_size <= gpus { "nccl" } else { host };
                (tch::Device::Cuda(self.local_rank % gpus), format!("cpu:{host},cuda:{gpu}"))
            }
            _ => (device, format!("cpu:{host}")),
        }
    }

    /// Reads the variables through `var` (the process environment in [`RankInfo::from_env`]).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<RankInfo> {
        // A count is read by its leading digits, as Slurm's lists (`2(x3)`) lead with one; the
        // tasks-per-node list itself is read whole, node by node, below.
        let number = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    let digits: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
                    digits.parse::<usize>().map_err(|_| Error::Comm(format!("{name}={v:?} is not a number")))
                })
                .transpose()
        };
        let Some(names) = SCHEMES.iter().find(|s| var(s[0]).is_some()) else {
            return Err(Error::Comm(
                "no rank in the environment (RANK, SLURM_PROCID or OMPI_COMM_WORLD_RANK); start with `strata launch`"
                    .into(),
            ));
        };
        let rank = number(names[0])?.unwrap_or(0);
        let world_size =
            number(names[1])?.ok_or_else(|| Error::Comm(format!("{} is set but {} is not", names[0], names[1])))?;
        if rank >= world_size {
            return Err(Error::Comm(format!("rank {rank} is outside a world of {world_size}")));
        }
        let local_rank = number(names[2])?.unwrap_or(rank);
        let local_world_size = match names[0] {
            // Slurm gives every job step its tasks per node (`SLURM_NTASKS_PER_NODE` only
            // with `--ntasks-per-node`); a rank that cannot tell counts itself alone, so it
            // never takes a multi-node job for one host.
            "SLURM_PROCID" => match (
                var("SLURM_STEP_TASKS_PER_NODE").or_else(|| var("SLURM_TASKS_PER_NODE")),
                number("SLURM_NODEID")?,
            ) {
                (Some(list), Some(node)) => slurm_tasks_on_node(&list, node).ok_or_else(|| {
                    Error::Comm(format!("SLURM_TASKS_PER_NODE={list:?} names no count for node {node}"))
                })?,
                _ => number(names[3])?.unwrap_or(1),
            },
            _ => number(names[3])?.unwrap_or(world_size),
        };
        let master_port = match var("MASTER_PORT") {
            Some(p) => p.trim().parse().map_err(|_| Error::Comm(format!("MASTER_PORT={p:?} is not a port")))?,
            None => 29500,
        };
        let rendezvous = match var("TORCHELASTIC_RUN_ID") {
            Some(run_id) => {
                if names[0] != "RANK" || var("MASTER_ADDR").is_none() || var("MASTER_PORT").is_none() {
                    return Err(Error::Comm(
                        "TORCHELASTIC_RUN_ID is set but RANK, MASTER_ADDR or MASTER_PORT is not: start under torchrun"
                            .into(),
                    ));
                }
                let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_none_or(|v| v == "True");
                Rendezvous::Torchrun { run_id, agent_store }
            }
            None => {
                let job = var("SLURM_JOB_ID")
                    .map(|j| format!("slurm-{j}"))
                    .or_else(|| var("OMPI_MCA_ess_base_jobid").map(|j| format!("ompi-{j}")));
                let token = match (var("STRATA_STORE_TOKEN"), job) {
                    (Some(token), _) => token,
                    (None, Some(job)) => derived_token(&job, var("HOME"))?,
                    (None, None) => {
                        return Err(Error::Comm("no job token: set STRATA_STORE_TOKEN (strata launch does)".into()))
                    }
                };
                Rendezvous::Strata { token }
            }
        };
        Ok(RankInfo {
            rank,
            world_size,
            local_rank,
            local_world_size,
            // Under Slurm without MASTER_ADDR the store lives on the job step's first node,
            // where rank 0 runs.
            master_addr: match (var("MASTER_ADDR"), var("SLURM_STEP_NODELIST").or_else(|| var("SLURM_JOB_NODELIST"))) {
                (Some(addr), _) => addr,
                (None, Some(list)) if names[0] == "SLURM_PROCID" => first_host(&list)?,
                (None, _) => "127.0.0.1".into(),
            },
            master_port,
            rendezvous,
        })
    }

    /// Reads this rank's identity from the process environment ([`RankInfo::from_vars`]).
    pub fn from_env() -> Result<RankInfo> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    fn store_addr(&self) -> Result<SocketAddr> {
        (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Comm(format!("cannot resolve MASTER_ADDR {}", self.master_addr)))
    }
}

/// The first host of a Slurm node list: `node[03-05,9],gpu1` gives `node03`.
fn first_host(list: &str) -> Result<String> {
    let bad = || Error::Comm(format!("cannot read the Slurm node list {list:?}: set MASTER_ADDR"));
    let head = list.split(',').next().filter(|h| !h.is_empty()).ok_or_else(bad)?;
    let Some((prefix, rest)) = head.split_once('[') else { return Ok(head.to_string()) };
    let first = rest.split(['-', ',', ']']).next().filter(|n| !n.is_empty()).ok_or_else(bad)?;
    Ok(format!("{prefix}{first}"))
}

/// A job's token when the launcher (Slurm, Open MPI) gives only a job id, which anyone can
/// read: derived from the id under a per-user secret, `~/.strata/secret`, created readable
/// by its owner only on first use. Where home folders are shared between nodes every node
/// derives the same token; elsewhere, set `STRATA_STORE_TOKEN`.
fn derived_token(job: &str, home: Option<String>) -> Result<String> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let how = "set STRATA_STORE_TOKEN to the same secret on every rank";
    let home = home
        .filter(|h| !h.is_empty())
        .ok_or_else(|| Error::Comm(format!("no job token and no HOME for a secret: {how}")))?;
    let dir = std::path::Path::new(&home).join(".strata");
    let path = dir.join("secret");
    let failed = |e: std::io::Error| Error::Comm(format!("job token secret {}: {e}; or {how}", path.display()));
    if !path.exists() {
        std::fs::create_dir_all(&dir).map_err(failed)?;
        // Written aside, then linked into place: concurrent first uses agree on one secret.
        let aside = dir.join(format!(".secret.{}", super::store::random_token()?));
        let mut f =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&aside).map_err(failed)?;
        std::io::Write::write_all(&mut f, super::store::random_token()?.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(failed)?;
        let linked = std::fs::hard_link(&aside, &path);
        let _ = std::fs::remove_file(&aside);
        match linked {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(failed(e)),
            _ => {}
        }
    }
    let meta = std::fs::metadata(&path).map_err(failed)?;
    // SAFETY: getuid has no preconditions.
    if std::os::unix::fs::MetadataExt::uid(&meta) != unsafe { libc::getuid() } {
        return Err(Error::Comm(format!("job token secret {} belongs to another user: {how}", path.display())));
    }
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(Error::Comm(format!(
            "job token secret {} is readable by others (mode {:o}): chmod 600 it, or {how}",
            path.display(),
            mode & 0o777
        )));
    }
    let secret = std::fs::read(&path).map_err(failed)?;
    if secret.len() < 16 {
        return Err(Error::Comm(format!(
            "job token secret {} is too short: remove it to make a new one, or {how}",
            path.display()
        )));
    }
    Ok(super::auth::derive(&secret, job.as_bytes()))
}

/// Joins the job described by the environment: under torchrun, the c10d store its agent
/// hosts at `MASTER_ADDR:MASTER_PORT`; otherwise rank 0 hosts Strata's store there and every
/// rank connects to it. `spec` picks backends per device.
pub fn init_from_env(spec: &str, timeout: Duration) -> Result<Comm> {
    let info = RankInfo::from_env()?;
    let addr = info.store_addr()?;
    let (store, server) = match &info.rendezvous {
        Rendezvous::Strata { token } => {
            let server = if info.rank == 0 { Some(StoreServer::start(addr, token)?) } else { None };
            (Store::connect(addr, token, timeout)?, server)
        }
        Rendezvous::Torchrun { run_id, agent_store } => {
            let prefix = format!("strata/{run_id}/");
            let host = !agent_store && info.rank == 0;
            let ranks = (info.rank, info.world_size);
            (Store::connect_c10d(addr, &prefix, ranks, host, timeout)?, None)
        }
    };
    Comm::new(store, server, info.rank, info.world_size, spec, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<RankInfo> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        RankInfo::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun_slurm_and_open_mpi_variables_are_recognised() {
        let t = read(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("STRATA_STORE_TOKEN", "t"),
        ])
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank, t.local_world_size, t.master_port), (3, 4, 1, 2, 1234));
        let s = read(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_ID", "77"),
            ("STRATA_STORE_TOKEN", "given"),
        ])
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.master_port), (5, 8, 1, 29500));
        assert_eq!(s.local_world_size, 1, "tasks per node unknown: alone on its node");
        assert_eq!(s.rendezvous, Rendezvous::Strata { token: "given".into() });
        let o =
            read(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"), ("STRATA_STORE_TOKEN", "x")]).unwrap();
        assert_eq!((o.rank, o.world_size, o.local_rank), (0, 2, 0));
    }

    #[test]
    fn ranks_take_their_own_gpu_and_share_one_through_the_host() {
        let rank = |local_rank, local_world_size, world_size| RankInfo {
            rank: local_rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            rendezvous: Rendezvous::Strata { token: String::new() },
        };
        let cuda = tch::Device::Cuda(0);
        assert_eq!(rank(1, 2, 2).placement(cuda, 2), (tch::Device::Cuda(1), "cpu:shm,cuda:nccl".into()));
        assert_eq!(rank(1, 2, 2).placement(cuda, 1), (tch::Device::Cuda(0), "cpu:shm,cuda:shm".into()));
        assert_eq!(rank(3, 4, 8).placement(cuda, 2), (tch::Device::Cuda(1), "cpu:tcp,cuda:tcp".into()));
        assert_eq!(rank(1, 2, 4).placement(tch::Device::Cpu, 8), (tch::Device::Cpu, "cpu:tcp".into()));
    }

    #[test]
    fn slurm_ranks_count_the_tasks_of_their_own_node() {
        assert_eq!(slurm_tasks_on_node("4", 0), Some(4));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 4), None);
        assert_eq!(slurm_tasks_on_node("2(x3", 0), None);
        let base = [("SLURM_PROCID", "6"), ("SLURM_NTASKS", "7"), ("SLURM_LOCALID", "0"), ("STRATA_STORE_TOKEN", "t")];
        let on = |extra: &[(&str, &str)]| read(&[&base[..], extra].concat()).map(|r| r.local_world_size);
        let list = ("SLURM_TASKS_PER_NODE", "2(x3),1");
        assert_eq!(on(&[list, ("SLURM_NODEID", "3")]).unwrap(), 1);
        assert_eq!(
            on(&[list, ("SLURM_NODEID", "1"), ("SLURM_STEP_TASKS_PER_NODE", "3,4")]).unwrap(),
            4,
            "the step's own"
        );
        assert_eq!(on(&[("SLURM_NTASKS_PER_NODE", "2")]).unwrap(), 2);
        assert!(on(&[list, ("SLURM_NODEID", "9")]).unwrap_err().to_string().contains("no count for node 9"));
    }

    #[test]
    fn a_slurm_job_without_a_token_derives_one_from_a_private_secret() {
        use std::os::unix::fs::PermissionsExt;
        let home = std::env::temp_dir().join(format!("strata-home-{}", std::process::id()));
        let h = home.to_str().unwrap();
        let slurm = |job: &str| {
            let vars = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", job), ("HOME", h)];
            read(&vars).map(|i| match i.rendezvous {
                Rendezvous::Strata { token } => token,
                other => panic!("{other:?}"),
            })
        };
        let (a, again, other) = (slurm("77").unwrap(), slurm("77").unwrap(), slurm("78").unwrap());
        assert_eq!(a, again, "every rank of a job derives the same token");
        assert_ne!(a, other, "another job, another token");
        assert_eq!(a.len(), 64);
        let secret = home.join(".strata/secret");
        // Not derivable from the job id alone: another user's secret gives another token.
        let kept = std::fs::read(&secret).unwrap();
        std::fs::remove_file(&secret).unwrap();
        assert_ne!(slurm("77").unwrap(), a, "the token depends on the secret");
        std::fs::write(&secret, kept).unwrap();
        assert_eq!(slurm("77").unwrap(), a);
        assert_eq!(std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(slurm("77").unwrap_err().to_string().contains("readable by others"));
        std::fs::remove_dir_all(&home).unwrap();
        let vars = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", "77")];
        assert!(
            read(&vars).unwrap_err().to_string().contains("STRATA_STORE_TOKEN"),
            "no HOME: refused with the way out"
        );
    }

    #[test]
    fn torchrun_is_recognised_and_half_set_variables_are_refused() {
        let torchrun = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29511"),
            ("TORCHELASTIC_RUN_ID", "job7"),
        ];
        let t = read(&torchrun).unwrap();
        assert_eq!(t.rendezvous, Rendezvous::Torchrun { run_id: "job7".into(), agent_store: true });
        let own = read(&[&torchrun[..], &[("TORCHELASTIC_USE_AGENT_STORE", "False")]].concat()).unwrap();
        assert_eq!(own.rendezvous, Rendezvous::Torchrun { run_id: "job7".into(), agent_store: false });
        for missing in ["MASTER_PORT", "MASTER_ADDR"] {
            let vars: Vec<_> = torchrun.iter().copied().filter(|(k, _)| *k != missing).collect();
            let err = read(&vars).unwrap_err().to_string();
            assert!(err.contains(missing) && !err.contains('\n'), "{missing}: {err}");
        }
    }

    #[test]
    fn under_slurm_the_store_is_on_the_step_s_first_node() {
        assert_eq!(first_host("node[03-05,9],gpu1").unwrap(), "node03");
        assert_eq!(first_host("gpu7,gpu8").unwrap(), "gpu7");
        assert_eq!(first_host("a[12]").unwrap(), "a12");
        assert!(first_host("").is_err() && first_host("n[").is_err());
        let slurm = |extra: &[(&str, &str)]| {
            let base = [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4"), ("STRATA_STORE_TOKEN", "t")];
            read(&[&base[..], extra].concat()).unwrap().master_addr
        };
        assert_eq!(slurm(&[("SLURM_STEP_NODELIST", "cn[2-3]")]), "cn2");
        assert_eq!(slurm(&[("SLURM_STEP_NODELIST", "cn[2-3]"), ("MASTER_ADDR", "10.1.1.1")]), "10.1.1.1");
        assert_eq!(slurm(&[]), "127.0.0.1");
    }

    #[test]
    fn inconsistent_variables_are_errors() {
        assert!(read(&[]).is_err());
        assert!(read(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("STRATA_STORE_TOKEN", "t")]).is_err());
        assert!(read(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("STRATA_STORE_TOKEN", "t")]).is_err());
        assert!(read(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err().to_string().contains("STRATA_STORE_TOKEN"));
    }
}
