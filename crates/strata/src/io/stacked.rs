//! Experts that a family's files stack into one tensor per projection (gpt-oss, Mistral 4,
//! Gemma 4), taken apart into each expert's weights on load and stacked again on save.
//!
//! gpt-oss's sparse layer `L` holds `L.mlp.experts.gate_up_proj` `[E, D, 2F]` (each
//! expert's input-major matrix, gate and up columns interleaved: gate, up, gate, ...),
//! `L.mlp.experts.gate_up_proj_bias` `[E, 2F]` (interleaved alike), `L.mlp.experts.down_proj`
//! `[E, F, D]` and `L.mlp.experts.down_proj_bias` `[E, D]`. Mistral 4's holds each expert's
//! output-major matrices as they are, the gate's rows before the up's: `gate_up_proj`
//! `[E, 2F, D]` and `down_proj` `[E, D, F]`, and Gemma 4's the same under `L.experts`. Here
//! each expert `e` has `L.mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}` (Gemma 4's
//! `L.experts.{e}...`), weights `[out, in]`.
//!
//! Released gpt-oss checkpoints hold the two weight stacks in MXFP4, which `quantized`
//! decodes into the stacked tensors they stand for before they come here.
use crate::model::hf::ExpertStacking;
use crate::{Error, Result};
use tch::Tensor;

/// The four stacked tensors, by their names' endings on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stack {
    GateUp,
    GateUpBias,
    Down,
    DownBias,
}

impl Stack {
    const ALL: [Stack; 4] = [Stack::GateUp, Stack::GateUpBias, Stack::Down, Stack::DownBias];

    fn disk_suffix(self) -> &'static str {
        match self {
            Stack::GateUp => "gate_up_proj",
            Stack::GateUpBias => "gate_up_proj_bias",
            Stack::Down => "down_proj",
            Stack::DownBias => "down_proj_bias",
        }
    }

    /// The per-expert parameters one expert's slice holds, by their names' endings.
    fn parts(self) -> &'static [&'static str] {
        match self {
            Stack::GateUp => &["gate_proj.weight", "up_proj.weight"],
            Stack::GateUpBias => &["gate_proj.bias", "up_proj.bias"],
            Stack::Down => &["down_proj.weight"],
            Stack::DownBias => &["down_proj.bias"],
        }
    }
}

/// Whether `name` on disk is one of a layer's stacked tensors.
pub(super) fn is_stacked(name: &str) -> bool {
    stacked_name(name).is_some()
}

/// `name` on disk as (module `L.mlp.experts` or `L.experts`, which stack), where it is one.
fn stacked_name(name: &str) -> Option<(&str, Stack)> {
    Stack::ALL.into_iter().find_map(|stack| {
        let module = name.strip_suffix(stack.disk_suffix())?.strip_suffix('.')?;
        module.ends_with(".experts").then_some((module, stack))
    })
}

/// A stack that the files may hold input-major or output-major (Qwen3-VL-MoE's) as the
/// output-major stack ([`ExpertStacking::Concatenated`]), told apart by where the hidden
/// width `dim` lies; output-major where both fit, as `transformers` reads a square stack.
pub(super) fn output_major(name: &str, t: Tensor, dim: i64) -> Result<Tensor> {
    let size = t.size();
    let input_major = match (stacked_name(name), size.as_slice()) {
        (Some((_, Stack::GateUp)), [_, rows, columns]) => *rows == dim && *columns != dim,
        (Some((_, Stack::Down)), [_, rows, columns]) => *columns == dim && *rows != dim,
        _ => false,
    };
    Ok(if input_major { t.f_transpose(1, 2)?.f_contiguous()? } else { t })
}

/// A tensor of the files, stacked as `stacking` says, taken apart into each expert's
/// parameters `(name, tensor)`; `None` where `name` is not a stacked tensor.
pub(super) fn unstack(name: &str, t: &Tensor, stacking: ExpertStacking) -> Result<Option<Vec<(String, Tensor)>>> {
    let Some((module, stack)) = stacked_name(name) else { return Ok(None) };
    let bad = || Error::Model(format!("{name}: shape {:?} is not a stack of experts", t.size()));
    let size = t.size();
    let experts = *size.first().ok_or_else(bad)?;
    let mut out = vec![];
    for e in 0..experts {
        let slice = t.f_get(e)?;
        let halves = |dim: i64| -> Result<Vec<Tensor>> { Ok(slice.f_chunk(2, dim)?) };
        let pieces = match (stack, stacking) {
            // [D, 2F] with gate and up columns interleaved: each [F, D].
            (Stack::GateUp, ExpertStacking::Interleaved) if size.len() == 3 && size[2] % 2 == 0 => {
                vec![slice.f_slice(1, 0, None, 2)?.f_tr()?, slice.f_slice(1, 1, None, 2)?.f_tr()?]
            }
            (Stack::GateUpBias, ExpertStacking::Interleaved) if size.len() == 2 && size[1] % 2 == 0 => {
                vec![slice.f_slice(0, 0, None, 2)?, slice.f_slice(0, 1, None, 2)?]
            }
            (Stack::Down, ExpertStacking::Interleaved) if size.len() == 3 => vec![slice.f_tr()?],
            // [2F, D]: the gate's rows, then the up's.
            (Stack::GateUp, ExpertStacking::Concatenated) if size.len() == 3 && size[1] % 2 == 0 => halves(0)?,
            (Stack::GateUpBias, ExpertStacking::Concatenated) if size.len() == 2 && size[1] % 2 == 0 => halves(0)?,
            (Stack::Down, ExpertStacking::Concatenated) if size.len() == 3 => vec![slice],
            // [D, 2F]: the gate's columns, then the up's; [F, D].
            (Stack::GateUp, ExpertStacking::InputMajor) if size.len() == 3 && size[2] % 2 == 0 => {
                slice.f_tr()?.f_chunk(2, 0)?
            }
            (Stack::Down, ExpertStacking::InputMajor) if size.len() == 3 => vec![slice.f_tr()?],
            (Stack::DownBias, _) if size.len() == 2 => vec![slice],
            _ => return Err(bad()),
        };
        for (part, piece) in stack.parts().iter().zip(pieces) {
            out.push((format!("{module}.{e}.{part}"), piece.f_contiguous()?));
        }
    }
    Ok(Some(out))
}

/// Where a tensor written to the files comes from: one parameter of the model, or the
/// parameters of every expert of a sparse layer stacked.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Source {
    /// Parameter `index` of the layout as it is (transposed where the family says).
    One { index: usize, transposed: bool },
    /// For each expert in order, the layout indices of its parameters ([`Stack::parts`]),
    /// joined as its files join them.
    Stacked { experts: Vec<Vec<usize>>, join: Join, transpose: bool },
}

/// How one expert's parts (gate and up) join in a stacked tensor: their last dimensions
/// interleaved, one after the other along the first, or one after the other along the last.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Join {
    Interleaved,
    Concatenated,
    Columns,
}

/// The tensors to write for a layout of parameter names, in order: each parameter as
/// itself, except the experts' parameters, which become their layers' stacked tensors as
/// `stacking` stacks them (at the place of each stack's first expert). Returns
/// `(name on disk, source)`.
pub(super) fn stack_layout(names: &[String], stacking: ExpertStacking) -> Result<Vec<(String, Source)>> {
    use std::collections::BTreeMap;
    // (module, stack) -> expert -> each part's layout index.
    type Parts = BTreeMap<i64, Vec<Option<usize>>>;
    let mut found: BTreeMap<(String, usize), Parts> = BTreeMap::new();
    let mut first_seen: Vec<(usize, (String, usize))> = vec![];
    let mut out_one = vec![];
    for (index, name) in names.iter().enumerate() {
        let split = name.split_once(".experts.").and_then(|(owner, rest)| {
            let (expert, part) = rest.split_once('.')?;
            let expert: i64 = expert.parse().ok()?;
            let (s, p) = Stack::ALL
                .iter()
                .enumerate()
                .find_map(|(s, stack)| stack.parts().iter().position(|p| *p == part).map(|p| (s, p)))?;
            Some((format!("{owner}.experts"), expert, s, p))
        });
        match split {
            Some((module, expert, s, p)) => {
                let key = (module, s);
                if !found.contains_key(&key) {
                    first_seen.push((index, key.clone()));
                }
                let parts = found.entry(key).or_default().entry(expert).or_insert_with(|| vec![None; 2]);
                parts[p] = Some(index);
            }
            None => out_one.push((index, name.clone())),
        }
    }
    let mut entries: Vec<(usize, String, Source)> =
        out_one.into_iter().map(|(index, name)| (index, name, Source::One { index, transposed: false })).collect();
    for (at, key) in first_seen {
        let stack = Stack::ALL[key.1];
        let by_expert = &found[&key];
        let mut experts = vec![];
        for (i, (e, parts)) in by_expert.iter().enumerate() {
            let wanted = stack.parts().len();
            let indices: Vec<usize> = parts[..wanted].iter().flatten().copied().collect();
            if *e != i as i64 || indices.len() != wanted {
                return Err(Error::Model(format!("{}: experts' parameters are not all there to stack", key.0)));
            }
            experts.push(indices);
        }
        let (join, transpose) = match (stacking, stack) {
            (ExpertStacking::Interleaved, Stack::GateUp) => (Join::Interleaved, true),
            (ExpertStacking::Interleaved, Stack::GateUpBias) => (Join::Interleaved, false),
            (ExpertStacking::Interleaved, Stack::Down) => (Join::Concatenated, true),
            (ExpertStacking::InputMajor, Stack::GateUp) => (Join::Columns, true),
            (ExpertStacking::InputMajor, Stack::Down) => (Join::Concatenated, true),
            (ExpertStacking::InputMajor, bias) => {
                return Err(Error::Model(format!("{}: Llama 4's files stack no {bias:?}", key.0)))
            }
            _ => (Join::Concatenated, false),
        };
        entries.push((at, format!("{}.{}", key.0, stack.disk_suffix()), Source::Stacked { experts, join, transpose }));
    }
    entries.sort_by_key(|(at, ..)| *at);
    Ok(entries.into_iter().map(|(_, name, source)| (name, source)).collect())
}

/// The stacked tensor of `experts` (each expert's parameters, fetched): each expert's
/// matrices transposed to input-major where `transpose`, its parts joined as `join` says,
/// the experts stacked along a new first dimension.
pub(super) fn stack(experts: Vec<Vec<Tensor>>, join: Join, transpose: bool) -> Result<Tensor> {
    let mut slices = Vec::with_capacity(experts.len());
    for parts in experts {
        let parts: Vec<Tensor> = parts
            .iter()
            .map(|p| if transpose { p.f_tr() } else { Ok(p.shallow_clone()) })
            .collect::<std::result::Result<_, _>>()?;
        let slice = match join {
            Join::Interleaved => {
                let last = parts[0].dim() as i64;
                let mut shape = parts[0].size();
                *shape.last_mut().ok_or_else(|| Error::Model("stacking a scalar".into()))? *= parts.len() as i64;
                Tensor::f_stack(&parts, last)?.f_reshape(shape)?
            }
            Join::Concatenated => Tensor::f_cat(&parts, 0)?,
            Join::Columns => Tensor::f_cat(&parts, -1)?,
        };
        slices.push(slice);
    }
    Ok(Tensor::f_stack(&slices, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_stacked_on_disk_come_apart_and_stack_again_exactly() {
        let (experts, dim, width) = (3, 4, 5);
        let gate_up = Tensor::randn([experts, dim, 2 * width], (tch::Kind::Float, tch::Device::Cpu));
        let bias = Tensor::randn([experts, 2 * width], (tch::Kind::Float, tch::Device::Cpu));
        let down = Tensor::randn([experts, width, dim], (tch::Kind::Float, tch::Device::Cpu));
        let mut params = vec![];
        for (name, t) in [
            ("model.layers.0.mlp.experts.gate_up_proj", &gate_up),
            ("model.layers.0.mlp.experts.gate_up_proj_bias", &bias),
            ("model.layers.0.mlp.experts.down_proj", &down),
        ] {
            params.extend(unstack(name, t, ExpertStacking::Interleaved).unwrap().unwrap());
        }
        // Expert 1's gate is column 2j of its slice, its up column 2j + 1.
        let gate1 = &params.iter().find(|(n, _)| n == "model.layers.0.mlp.experts.1.gate_proj.weight").unwrap().1;
        assert_eq!(gate1.size(), [width, dim]);
        assert!(gate1.equal(&gate_up.get(1).slice(1, 0, None, 2).tr()));
        let up_bias = &params.iter().find(|(n, _)| n == "model.layers.0.mlp.experts.2.up_proj.bias").unwrap().1;
        assert!(up_bias.equal(&bias.get(2).slice(0, 1, None, 2)));
        assert!(unstack("model.layers.0.mlp.router.weight", &bias, ExpertStacking::Interleaved).unwrap().is_none());
        // Back: a name before and after, the experts' parameters in the model's order.
        let mut names = vec!["model.layers.0.input_layernorm.weight".to_string()];
        names.extend(params.iter().map(|(n, _)| n.clone()));
        names.push("model.norm.weight".into());
        let layout = stack_layout(&names, ExpertStacking::Interleaved).unwrap();
        let disk: Vec<&str> = layout.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            disk,
            [
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.mlp.experts.gate_up_proj",
                "model.layers.0.mlp.experts.gate_up_proj_bias",
                "model.layers.0.mlp.experts.down_proj",
                "model.norm.weight"
            ]
        );
        for ((_, source), original) in layout[1..4].iter().zip([&gate_up, &bias, &down]) {
            let Source::Stacked { experts, join, transpose } = source else { panic!("{source:?}") };
            let fetched =
                experts.iter().map(|parts| parts.iter().map(|&i| params[i - 1].1.shallow_clone()).collect()).collect();
            assert!(stack(fetched, *join, *transpose).unwrap().equal(original));
        }
    }

    /// Mistral 4's stacks: each expert's gate rows before its up rows, output-major, taken
    /// apart and stacked again exactly.
    #[test]
    fn concatenated_stacks_come_apart_and_stack_again_exactly() {
        let (experts, dim, width) = (3, 4, 5);
        let gate_up = Tensor::randn([experts, 2 * width, dim], (tch::Kind::Float, tch::Device::Cpu));
        let down = Tensor::randn([experts, dim, width], (tch::Kind::Float, tch::Device::Cpu));
        let mut params = vec![];
        for (name, t) in
            [("m.layers.1.mlp.experts.gate_up_proj", &gate_up), ("m.layers.1.mlp.experts.down_proj", &down)]
        {
            params.extend(unstack(name, t, ExpertStacking::Concatenated).unwrap().unwrap());
        }
        let up2 = &params.iter().find(|(n, _)| n == "m.layers.1.mlp.experts.2.up_proj.weight").unwrap().1;
        assert!(up2.equal(&gate_up.get(2).narrow(0, width, width)));
        let down0 = &params.iter().find(|(n, _)| n == "m.layers.1.mlp.experts.0.down_proj.weight").unwrap().1;
        assert!(down0.equal(&down.get(0)));
        let names: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
        let layout = stack_layout(&names, ExpertStacking::Concatenated).unwrap();
        for ((_, source), original) in layout.iter().zip([&gate_up, &down]) {
            let Source::Stacked { experts, join, transpose } = source else { panic!("{source:?}") };
            let fetched =
                experts.iter().map(|parts| parts.iter().map(|&i| params[i].1.shallow_clone()).collect()).collect();
            assert!(stack(fetched, *join, *transpose).unwrap().equal(original));
        }
    }
}
