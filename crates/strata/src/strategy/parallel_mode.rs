//! `parallel_mode`: how the ranks are laid out, `([(name, size), ...], rank_order)`. The
//! first dimension varies fastest: with `[("tensor", 4), ("pipeline", 2), ("data", 2)]` on
//! 16 ranks the tensor groups are `[0..4)`, `[4..8)`, …, the pipeline groups `[0, 4]`,
//! `[1, 5]`, …, the data groups `[0, 8]`, `[1, 9]`, …. `rank_order` lists the rank at each
//! position (`None`: position = rank). The data size follows the world size: the product of
//! the others must divide it, and data takes the rest.
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// A dimension of the rank layout ([`crate::parallel::Mesh`]): data parallel (replicas),
/// ZeRO data parallel (the shard groups), tensor, pipeline, context and expert parallel.
/// Written in strategies by its lower-case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dim {
    /// Data parallelism: replicas of the model.
    Data,
    /// ZeRO data parallelism: the shard groups of `zero1`, `zero2` and `fsdp`.
    Zero,
    /// Tensor parallelism: units split over the group's ranks.
    Tensor,
    /// Pipeline parallelism: the model's units split into stages.
    Pipeline,
    /// Context parallelism: each row's positions split over the group's ranks.
    Context,
    /// Expert parallelism: the groups a mixture of experts' experts are split over.
    Expert,
}

impl Dim {
    /// Every dimension, in the order strategies list them by default.
    pub const ALL: [Dim; 6] = [Dim::Data, Dim::Zero, Dim::Tensor, Dim::Pipeline, Dim::Context, Dim::Expert];

    /// The dimension's name in a strategy.
    pub fn name(self) -> &'static str {
        match self {
            Dim::Data => "data",
            Dim::Zero => "zero",
            Dim::Tensor => "tensor",
            Dim::Pipeline => "pipeline",
            Dim::Context => "context",
            Dim::Expert => "expert",
        }
    }
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `parallel_mode`'s value: the dimensions with their sizes, fastest first (data's follows
/// the world size), and the rank at each position (`None`: position = rank).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParallelMode(pub Vec<(Dim, usize)>, pub Option<Vec<usize>>);

impl Default for ParallelMode {
    fn default() -> Self {
        ParallelMode(vec![(Dim::Data, 0)], None)
    }
}

fn bad(message: String) -> Error {
    Error::Config(format!("parallel_mode: {message}"))
}

impl ParallelMode {
    /// Checks sizes and the rank order, independently of the world size.
    pub fn validate(&self) -> Result<()> {
        for (i, (name, size)) in self.0.iter().enumerate() {
            if self.0[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(format!("dimension {name} appears twice")));
            }
            if *size == 0 && *name != Dim::Data {
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
    pub fn resolve(&self, world: usize) -> Result<Vec<(Dim, usize)>> {
        self.validate()?;
        let product = self.0.iter().filter(|(n, _)| *n != Dim::Data).try_fold(1usize, |p, (_, s)| p.checked_mul(*s));
        let Some(others) = product.filter(|&o| o > 0 && world > 0 && world.is_multiple_of(o)) else {
            let sizes: Vec<String> =
                self.0.iter().filter(|(n, _)| *n != Dim::Data).map(|(n, s)| format!("{n} {s}")).collect();
            let ranks = product.map_or("more".to_string(), |p| p.to_string());
            return Err(bad(format!("{} = {ranks} ranks do not divide the world size {world}", sizes.join(" × "))));
        };
        let mut dims = self.0.clone();
        match dims.iter_mut().find(|(n, _)| *n == Dim::Data) {
            Some(d) => d.1 = world / others,
            None => dims.push((Dim::Data, world / others)),
        }
        if let Some(order) = &self.1 {
            if order.len() != world {
                return Err(bad(format!("the rank order lists {} ranks, the world has {world}", order.len())));
            }
        }
        Ok(dims)
    }

    /// The size of dimension `dim` at `world` ranks (1 when absent).
    pub fn size(&self, dim: Dim, world: usize) -> Result<usize> {
        Ok(self.resolve(world)?.iter().find(|(n, _)| *n == dim).map_or(1, |(_, s)| *s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use Dim::{Context, Data, Expert, Pipeline, Tensor, Zero};

    fn mode(dims: &[(Dim, usize)]) -> ParallelMode {
        ParallelMode(dims.to_vec(), None)
    }

    #[test]
    fn data_follows_the_world_size_and_the_rest_must_divide_it() {
        assert_eq!(mode(&[(Data, 8)]).resolve(16).unwrap(), [(Data, 16)]);
        let adjusted = mode(&[(Tensor, 2), (Pipeline, 2), (Data, 2)]).resolve(16).unwrap();
        assert_eq!(adjusted[2], (Data, 4));
        assert_eq!(mode(&[(Zero, 2)]).resolve(8).unwrap()[1], (Data, 4), "data is appended");
        let err = mode(&[(Tensor, 4), (Pipeline, 2)]).resolve(12).unwrap_err().to_string();
        assert!(err.contains("tensor 4 × pipeline 2 = 8 ranks do not divide the world size 12"), "{err}");
        let huge = mode(&[(Tensor, usize::MAX / 2 + 1), (Pipeline, 2)]).resolve(16).unwrap_err().to_string();
        assert!(huge.contains("= more ranks do not divide the world size 16"), "{huge}");
        let unknown = serde_json::from_str::<ParallelMode>(r#"[[["sequence", 2]], null]"#).unwrap_err().to_string();
        assert!(unknown.contains("sequence") && unknown.contains("`data`, `zero`, `tensor`, `pipeline`"), "{unknown}");
        // The expert and context dimensions are their methods' (the strategy checks that
        // the method is given).
        let expert: ParallelMode = serde_json::from_str(r#"[[["expert", 2]], null]"#).unwrap();
        assert_eq!(expert.resolve(4).unwrap(), [(Expert, 2), (Data, 2)]);
        let context: ParallelMode = serde_json::from_str(r#"[[["context", 2]], null]"#).unwrap();
        assert_eq!(context.resolve(4).unwrap(), [(Context, 2), (Data, 2)]);
        assert_eq!(serde_json::to_string(&mode(&[(Tensor, 2)])).unwrap(), r#"[[["tensor",2]],null]"#);
        let twice = mode(&[(Tensor, 2), (Tensor, 2)]).validate().unwrap_err().to_string();
        assert!(twice.contains("dimension tensor appears twice"), "{twice}");
        let reordered = ParallelMode(vec![(Zero, 2)], Some(vec![3, 2, 1, 0]));
        assert!(reordered.resolve(4).is_ok());
        assert!(reordered.resolve(8).is_err(), "a rank order is for one world size");
    }
}
