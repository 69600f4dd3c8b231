//! `parallel_mode`: how the ranks are laid out, `([(name, size), ...], rank_order)`. The
//! first dimension varies fastest: with `[("tensor", 4), ("pipeline", 2), ("data", 2)]` on
//! 16 ranks the tensor groups are `[0..4)`, `[4..8)`, …, the pipeline groups `[0, 4]`,
//! `[1, 5]`, …, the data groups `[0, 8]`, `[1, 9]`, …. `rank_order` lists the rank at each
//! position (`None`: position = rank). The data size follows the world size: the product of
//! the others must divide it, and data takes the rest.
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Dimension names: data parallel, ZeRO data parallel (the shard groups), tensor and
/// pipeline parallel.
pub const DIMENSIONS: [&str; 4] = ["data", "zero", "tensor", "pipeline"];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParallelMode(pub Vec<(String, usize)>, pub Option<Vec<usize>>);

impl Default for ParallelMode {
    fn default() -> Self {
        ParallelMode(vec![("data".into(), 0)], None)
    }
}

fn bad(message: String) -> Error {
    Error::Config(format!("parallel_mode: {message}"))
}

impl ParallelMode {
    /// Checks names, sizes and the rank order, independently of the world size.
    pub fn validate(&self) -> Result<()> {
        for (i, (name, size)) in self.0.iter().enumerate() {
            if !DIMENSIONS.contains(&name.as_str()) {
                return Err(bad(format!("unknown dimension {name:?}; allowed: {}", DIMENSIONS.join(", "))));
            }
            if self.0[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(format!("dimension {name:?} appears twice")));
            }
            if *size == 0 && name != "data" {
                return Err(bad(format!("{name} needs a positive size")));
            }
        }
        if let Some(order) = &self.1 {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            if sorted.iter().enumerate().any(|(i, &r)| i != r) {
                return Err(bad(format!("rank order {order:?} is not a permutation of 0..{}", order.len())));
            }
        }
        Ok(())
    }

    /// The sizes at `world` ranks: data adjusted (appended when absent) so that the
    /// product of all sizes is the world size.
    pub fn resolve(&self, world: usize) -> Result<Vec<(String, usize)>> {
        self.validate()?;
        let product = self.0.iter().filter(|(n, _)| n != "data").try_fold(1usize, |p, (_, s)| p.checked_mul(*s));
        let Some(others) = product.filter(|&o| o > 0 && world > 0 && world.is_multiple_of(o)) else {
            let sizes: Vec<String> =
                self.0.iter().filter(|(n, _)| n != "data").map(|(n, s)| format!("{n} {s}")).collect();
            let ranks = product.map_or("more".to_string(), |p| p.to_string());
            return Err(bad(format!("{} = {ranks} ranks do not divide the world size {world}", sizes.join(" × "))));
        };
        let mut dims = self.0.clone();
        match dims.iter_mut().find(|(n, _)| n == "data") {
            Some(d) => d.1 = world / others,
            None => dims.push(("data".into(), world / others)),
        }
        if let Some(order) = &self.1 {
            if order.len() != world {
                return Err(bad(format!("the rank order lists {} ranks, the world has {world}", order.len())));
            }
        }
        Ok(dims)
    }

    /// The size of dimension `name` at `world` ranks (1 when absent).
    pub fn size(&self, name: &str, world: usize) -> Result<usize> {
        Ok(self.resolve(world)?.iter().find(|(n, _)| n == name).map_or(1, |(_, s)| *s))
    }

    /// The process groups of every dimension at `world` ranks, each group in position order,
    /// groups ordered by their first position.
    pub fn groups(&self, world: usize) -> Result<BTreeMap<String, Vec<Vec<usize>>>> {
        let dims = self.resolve(world)?;
        let rank_at = |p: usize| self.1.as_ref().map_or(p, |o| o[p]);
        let mut out = BTreeMap::new();
        let mut stride = 1;
        for (name, size) in &dims {
            let mut groups = Vec::new();
            for p in 0..world {
                // The first position of each group has coordinate 0 in this dimension.
                if (p / stride) % size == 0 {
                    groups.push((0..*size).map(|c| rank_at(p + c * stride)).collect());
                }
            }
            out.insert(name.clone(), groups);
            stride *= size;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(dims: &[(&str, usize)]) -> ParallelMode {
        ParallelMode(dims.iter().map(|(n, s)| (n.to_string(), *s)).collect(), None)
    }

    #[test]
    fn the_seed_example_gives_its_groups() {
        let g = mode(&[("tensor", 4), ("pipeline", 2), ("data", 2)]).groups(16).unwrap();
        let tensor: Vec<Vec<usize>> = (0..4).map(|i| (4 * i..4 * i + 4).collect()).collect();
        assert_eq!(g["tensor"], tensor);
        let pipeline = [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]];
        assert_eq!(g["pipeline"], pipeline.map(|p| p.to_vec()).to_vec());
        let data: Vec<Vec<usize>> = (0..8).map(|i| vec![i, i + 8]).collect();
        assert_eq!(g["data"], data);
    }

    #[test]
    fn data_follows_the_world_size_and_the_rest_must_divide_it() {
        assert_eq!(mode(&[("data", 8)]).resolve(16).unwrap(), [("data".to_string(), 16)]);
        let adjusted = mode(&[("tensor", 2), ("pipeline", 2), ("data", 2)]).resolve(16).unwrap();
        assert_eq!(adjusted[2], ("data".to_string(), 4));
        assert_eq!(mode(&[("zero", 2)]).resolve(8).unwrap()[1], ("data".to_string(), 4), "data is appended");
        let err = mode(&[("tensor", 4), ("pipeline", 2)]).resolve(12).unwrap_err().to_string();
        assert!(err.contains("tensor 4 × pipeline 2 = 8 ranks do not divide the world size 12"), "{err}");
        let huge = mode(&[("tensor", usize::MAX / 2 + 1), ("pipeline", 2)]).resolve(16).unwrap_err().to_string();
        assert!(huge.contains("= more ranks do not divide the world size 16"), "{huge}");
        assert!(mode(&[("expert", 2)])
            .validate()
            .unwrap_err()
            .to_string()
            .contains("allowed: data, zero, tensor, pipeline"));
        let reordered = ParallelMode(vec![("zero".into(), 2)], Some(vec![3, 2, 1, 0]));
        assert_eq!(reordered.groups(4).unwrap()["zero"], [vec![3, 2], vec![1, 0]]);
        assert!(reordered.resolve(8).is_err(), "a rank order is for one world size");
    }
}
