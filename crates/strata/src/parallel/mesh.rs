//! The device mesh: the one layout of a job's ranks over named dimensions, derived once from
//! the world and the strategy. Every parallel method takes its groups, its coordinate and
//! its peers from here, so that no two methods can disagree about which ranks share what.
//!
//! Owns: resolving `parallel_mode` and the ZeRO method's shard group size into dimension
//! sizes, the rank at each position, and the group lists of any set of dimensions. Must not
//! create process groups (callers create every group of a list, in order, on every rank) nor
//! read anything but the strategy and the world.
//!
//! The dimensions, in the layout's order (the first varies fastest unless `parallel_mode`
//! lists them otherwise): `tensor` (units split), `zero` (data parallel, sharded: the shard
//! groups of zero1/zero2/fsdp), `data` (data parallel, replicated: the shard groups'
//! replicas), `pipeline` (consecutive stages), `expert` (data-parallel ranks whose sparse
//! layers send each token to the rank computing its expert: every rank of an expert group
//! reads batches of its own, so the data-parallel ranks are those of zero × data × expert);
//! `context` (ranks holding pieces of the same rows: they read the same batches and average
//! their gradients as replicas do).
use crate::strategy::{Dim, ShardingStrategy, Strategy};
use crate::{Error, Result};

/// Where each rank sits on each named dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct Mesh {
    world: usize,
    rank: usize,
    /// Every dimension a strategy can name, in layout order (the first varies fastest); those
    /// the strategy leaves out have size 1.
    dims: Vec<(Dim, usize)>,
    /// The rank at each position (`None`: position = rank).
    order: Option<Vec<usize>>,
}

fn bad(message: String) -> Error {
    Error::Config(format!("parallel_mode: {message}"))
}

impl Mesh {
    /// The mesh `strategy` makes of `world` ranks, seen from `rank`; `local_world_size` ranks
    /// share a host (HYBRID_SHARD's default shard group).
    ///
    /// The sizes are `parallel_mode`'s, data taking what the others leave. Under zero1, zero2
    /// or fsdp the replicas (the ranks holding the same units and pieces) split into shard
    /// groups: `parallel_mode`'s `zero` size where it names one, in its place; otherwise the
    /// sharding strategy's size (FULL_SHARD: every replica; NO_SHARD: 1; HYBRID_SHARD:
    /// `hybrid_shard_size`, or the ranks of a host over the tensor size), placed just before
    /// `data`, so that data parallelism's groups keep their ranks.
    pub fn new(strategy: &Strategy, world: usize, rank: usize, local_world_size: usize) -> Result<Mesh> {
        let mode = strategy.parallel_mode();
        let mut dims = mode.resolve(world)?;
        if rank >= world {
            return Err(bad(format!("rank {rank} is outside a world of {world}")));
        }
        let size = |dims: &[(Dim, usize)], dim: Dim| dims.iter().find(|(n, _)| *n == dim).map_or(1, |(_, s)| *s);
        let named_zero = dims.iter().any(|(n, _)| *n == Dim::Zero);
        match strategy.sharding() {
            None if size(&dims, Dim::Zero) > 1 => {
                return Err(bad("a zero dimension needs zero1, zero2 or fsdp".into()));
            }
            None => {}
            Some((name, shard))
                if named_zero
                    && (shard.sharding_strategy == Some(ShardingStrategy::HybridShard)
                        || shard.hybrid_shard_size.is_some()) =>
            {
                return Err(Error::Config(format!(
                    "{name}: give the shard group size once, as parallel_mode's zero size or as hybrid_shard_size"
                )));
            }
            // The zero size parallel_mode names is the shard group's.
            Some(_) if named_zero => {}
            Some((name, shard)) => {
                let replicas = size(&dims, Dim::Data);
                let tensor = size(&dims, Dim::Tensor);
                let shard_size = match shard.sharding_strategy {
                    Some(ShardingStrategy::NoShard) => 1,
                    Some(ShardingStrategy::HybridShard) => {
                        shard.hybrid_shard_size.unwrap_or((local_world_size / tensor).max(1))
                    }
                    _ => replicas,
                };
                if shard_size == 0 || !replicas.is_multiple_of(shard_size) {
                    let whole = match world / replicas {
                        1 => format!("the world size {world}"),
                        _ => format!("the {replicas} ranks that hold the same units and pieces"),
                    };
                    return Err(Error::Config(format!(
                        "{name}: a shard group of {shard_size} ranks does not divide {whole}"
                    )));
                }
                let at = dims.iter().position(|(n, _)| *n == Dim::Data).unwrap_or(dims.len());
                dims[at].1 = replicas / shard_size;
                dims.insert(at, (Dim::Zero, shard_size));
            }
        }
        for dim in Dim::ALL {
            if !dims.iter().any(|(n, _)| *n == dim) {
                dims.push((dim, 1));
            }
        }
        Ok(Mesh { world, rank, dims, order: mode.1 })
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// This rank's index among the job's ranks.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Every dimension and its size, in layout order.
    pub fn dims(&self) -> &[(Dim, usize)] {
        &self.dims
    }

    /// The size of `dim`.
    pub fn size(&self, dim: Dim) -> usize {
        self.dims.iter().find(|(n, _)| *n == dim).map_or(1, |(_, s)| *s)
    }

    fn rank_at(&self, position: usize) -> usize {
        self.order.as_ref().map_or(position, |o| o[position])
    }

    fn position_of(&self, rank: usize) -> usize {
        self.order.as_ref().and_then(|o| o.iter().position(|&r| r == rank)).unwrap_or(rank)
    }

    /// The position's coordinate on every dimension, in layout order.
    fn coordinates(&self, position: usize) -> Vec<usize> {
        let mut stride = 1;
        self.dims
            .iter()
            .map(|(_, size)| {
                let c = (position / stride) % size;
                stride *= size;
                c
            })
            .collect()
    }

    /// This rank's coordinate on `dim`.
    pub fn coordinate(&self, dim: Dim) -> usize {
        let at = self.dims.iter().position(|(n, _)| *n == dim).unwrap_or(0);
        self.coordinates(self.position_of(self.rank))[at]
    }

    /// The groups spanning `dims` together (the ranks whose coordinates differ on those
    /// dimensions alone), each group ordered by its coordinates in layout order, the groups
    /// ordered by their first position. Every rank lists the same groups in the same order.
    pub fn groups(&self, dims: &[Dim]) -> Vec<Vec<usize>> {
        let spans: Vec<bool> = self.dims.iter().map(|(n, _)| dims.contains(n)).collect();
        let mut groups: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
        for position in 0..self.world {
            // A group's key: the coordinates on the dimensions it does not span.
            let key: Vec<usize> = self
                .coordinates(position)
                .into_iter()
                .zip(&spans)
                .map(|(c, &spanned)| if spanned { 0 } else { c })
                .collect();
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, ranks)) => ranks.push(self.rank_at(position)),
                None => groups.push((key, vec![self.rank_at(position)])),
            }
        }
        groups.into_iter().map(|(_, ranks)| ranks).collect()
    }

    /// This rank's group over `dims` ([`Mesh::groups`]).
    pub fn peers(&self, dims: &[Dim]) -> Vec<usize> {
        self.groups(dims).into_iter().find(|g| g.contains(&self.rank)).unwrap_or_else(|| vec![self.rank])
    }

    /// The dimensions whose ranks read different batches and average their gradients.
    pub const DATA_PARALLEL: [Dim; 3] = [Dim::Zero, Dim::Data, Dim::Expert];

    /// The dimensions whose ranks hold the same units and pieces and average their
    /// gradients: the data-parallel ones, and context ranks (pieces of the same rows).
    pub const REPLICAS: [Dim; 4] = [Dim::Zero, Dim::Data, Dim::Expert, Dim::Context];

    /// Which of the data-parallel replicas this rank's batches belong to, and how many there
    /// are: ranks that differ only in their tensor or pipeline coordinate read the same
    /// batches. (index, count).
    pub fn batch_shard(&self) -> (usize, usize) {
        let peers = self.peers(&Self::DATA_PARALLEL);
        (peers.iter().position(|&r| r == self.rank).unwrap_or(0), peers.len())
    }

    /// This rank's place in its pipeline (its stage), and the pipelines' rank lists, each in
    /// stage order.
    pub fn pipelines(&self) -> (usize, Vec<Vec<usize>>) {
        (self.coordinate(Dim::Pipeline), self.groups(&[Dim::Pipeline]))
    }
}

/// The sizes in layout order, those above 1 (`data 1` for one process).
impl std::fmt::Display for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let used: Vec<String> = self.dims.iter().filter(|(_, s)| *s > 1).map(|(n, s)| format!("{n} {s}")).collect();
        match used.is_empty() {
            true => write!(f, "data 1"),
            false => write!(f, "{}", used.join(" × ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::Strategy;
    use proptest::prelude::*;
    use serde_json::json;

    fn strategy(value: serde_json::Value) -> Strategy {
        Strategy::from_value(&value).unwrap()
    }

    fn mode(dims: &[(&str, usize)]) -> serde_json::Value {
        json!(["parallel_mode", [dims.iter().map(|(n, s)| json!([n, s])).collect::<Vec<_>>(), null]])
    }

    #[test]
    fn fsdp_splits_the_replicas_into_shard_groups_in_place_of_data() {
        let s = strategy(
            json!([mode(&[("tensor", 2)]), "tensor_parallel", ["fsdp", {"sharding_strategy": "HYBRID_SHARD"}]]),
        );
        let mesh = Mesh::new(&s, 8, 5, 4).unwrap();
        assert_eq!(mesh.size(Dim::Tensor), 2);
        assert_eq!(mesh.size(Dim::Zero), 2, "a host of 4 over a tensor size of 2");
        assert_eq!(mesh.size(Dim::Data), 2);
        assert_eq!(mesh.groups(&[Dim::Tensor])[0], [0, 1]);
        assert_eq!(mesh.groups(&[Dim::Zero]), [[0, 2], [1, 3], [4, 6], [5, 7]]);
        assert_eq!(mesh.groups(&[Dim::Data])[0], [0, 4]);
        assert_eq!(mesh.peers(&[Dim::Zero, Dim::Data]), [1, 3, 5, 7]);
        assert_eq!(mesh.batch_shard(), (2, 4));
        assert_eq!(mesh.to_string(), "tensor 2 × zero 2 × data 2");
        let full = Mesh::new(&strategy(json!(["fsdp"])), 4, 0, 4).unwrap();
        assert_eq!((full.size(Dim::Zero), full.size(Dim::Data)), (4, 1));
        let none = Mesh::new(&strategy(json!([["fsdp", {"sharding_strategy": "NO_SHARD"}]])), 4, 0, 4).unwrap();
        assert_eq!((none.size(Dim::Zero), none.size(Dim::Data)), (1, 4));
    }

    #[test]
    fn a_named_zero_dimension_keeps_its_place_beside_tensor() {
        // Zero listed first varies fastest: shard groups are adjacent ranks, tensor groups
        // stride over them, and no group of one dimension shares two ranks with the other's.
        let s = strategy(json!([mode(&[("zero", 2), ("tensor", 2)]), "tensor_parallel", "fsdp"]));
        let mesh = Mesh::new(&s, 8, 0, 8).unwrap();
        assert_eq!(mesh.groups(&[Dim::Zero])[0], [0, 1]);
        assert_eq!(mesh.groups(&[Dim::Tensor])[0], [0, 2]);
        assert_eq!(mesh.groups(&[Dim::Data])[0], [0, 4]);
    }

    #[test]
    fn the_seed_example_and_the_peers_layouts_give_their_groups() {
        let mesh =
            Mesh::new(&strategy(json!([mode(&[("tensor", 4), ("pipeline", 2), ("data", 2)])])), 16, 0, 16).unwrap();
        let tensor: Vec<Vec<usize>> = (0..4).map(|i| (4 * i..4 * i + 4).collect()).collect();
        assert_eq!(mesh.groups(&[Dim::Tensor]), tensor);
        let pipeline = [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]];
        assert_eq!(mesh.groups(&[Dim::Pipeline]), pipeline.map(|p| p.to_vec()).to_vec());
        let data: Vec<Vec<usize>> = (0..8).map(|i| vec![i, i + 8]).collect();
        assert_eq!(mesh.groups(&[Dim::Data]), data);
        // mixed_parallel keeps parallel_mode's order: pipeline neighbours are adjacent ranks;
        // ds_3d_parallel lays ranks out as DeepSpeed does: tensor, then data, then pipeline.
        let layout = mode(&[("pipeline", 2), ("tensor", 2)]);
        let mixed = Mesh::new(&strategy(json!([layout, "mixed_parallel"])), 8, 0, 8).unwrap();
        assert_eq!(mixed.groups(&[Dim::Pipeline])[0], [0, 1]);
        let ds = Mesh::new(&strategy(json!([layout, "ds_3d_parallel"])), 8, 0, 8).unwrap();
        assert_eq!(ds.groups(&[Dim::Tensor])[0], [0, 1]);
        assert_eq!(ds.groups(&[Dim::Data])[0], [0, 2]);
        assert_eq!(ds.groups(&[Dim::Pipeline])[0], [0, 4]);
        let reordered =
            Mesh::new(&strategy(json!([["parallel_mode", [[["zero", 2]], [3, 2, 1, 0]]], "zero1"])), 4, 1, 4);
        assert_eq!(reordered.unwrap().groups(&[Dim::Zero]), [vec![3, 2], vec![1, 0]]);
    }

    #[test]
    fn refusals_name_the_cause() {
        let err =
            |s: serde_json::Value, world: usize| Mesh::new(&strategy(s), world, 0, world).unwrap_err().to_string();
        assert!(err(json!([mode(&[("zero", 2)])]), 4).contains("a zero dimension needs zero1, zero2 or fsdp"));
        let hybrid = err(
            json!([mode(&[("zero", 2)]), ["fsdp", {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}]]),
            4,
        );
        assert!(hybrid.contains("give the shard group size once"), "{hybrid}");
        let three = err(json!([["fsdp", {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 3}]]), 4);
        assert!(three.contains("a shard group of 3 ranks does not divide the world size 4"), "{three}");
        let rank = Mesh::new(&Strategy::default(), 2, 2, 2).unwrap_err().to_string();
        assert!(rank.contains("rank 2 is outside a world of 2"), "{rank}");
    }

    proptest! {
        /// Over any layout, every rank has one coordinate tuple, each dimension's groups
        /// partition the world, and a group spanning two dimensions is the product of theirs.
        #[test]
        fn the_groups_of_every_dimension_partition_the_world(
            tensor in 1usize..4, pipeline in 1usize..4, zero in 1usize..3, data in 1usize..3,
            rotate in 0usize..4, reversed in any::<bool>(),
        ) {
            let world = tensor * pipeline * zero * data;
            let mut dims = [("tensor", tensor), ("pipeline", pipeline), ("zero", zero), ("data", data)];
            dims.rotate_left(rotate);
            let order: Option<Vec<usize>> = reversed.then(|| (0..world).rev().collect());
            let s = strategy(json!([
                ["parallel_mode", [dims.iter().map(|(n, s)| json!([n, s])).collect::<Vec<_>>(), order]],
                "zero1"
            ]));
            for rank in 0..world {
                let mesh = Mesh::new(&s, world, rank, world).unwrap();
                for dim in Dim::ALL {
                    let groups = mesh.groups(&[dim]);
                    let mut all: Vec<usize> = groups.concat();
                    all.sort_unstable();
                    prop_assert_eq!(all, (0..world).collect::<Vec<_>>());
                    prop_assert!(groups.iter().all(|g| g.len() == mesh.size(dim)));
                    prop_assert_eq!(mesh.peers(&[dim])[mesh.coordinate(dim)], rank);
                }
                let both = mesh.peers(&[Dim::Zero, Dim::Data]);
                prop_assert_eq!(both.len(), zero * data);
                prop_assert!(mesh.peers(&[Dim::Zero]).iter().all(|r| both.contains(r)));
                prop_assert!(mesh.peers(&[Dim::Data]).iter().all(|r| both.contains(r)));
                prop_assert_eq!(mesh.peers(&[Dim::Tensor]).iter().filter(|r| both.contains(r)).count(), 1);
            }
        }
    }
}
