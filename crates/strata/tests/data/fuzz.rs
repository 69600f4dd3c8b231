//! Property tests of everything that reads outside input: strategy text, a checkpoint's
//! `meta.json` and safetensors files. Whatever the bytes, the answer is a value or one clear
//! error — never a panic, never a huge allocation, and never a change to the files read.
use proptest::prelude::*;
use serde_json::{json, Value};
use std::path::Path;
use strata::checkpoint::{self, Checkpoint, DataPosition, RunInfo};
use strata::engine::{Engine, EngineConfig};
use strata::model::{self, Builder, MlpConfig};
use strata::optim::{Optimizer, OptimizerConfig};
use strata::strategy::Strategy as StrataStrategy;
use tch::Tensor;

fn one_line(e: &strata::Error) -> bool {
    let text = e.to_string();
    !text.is_empty() && !text.contains('\n')
}

/// Pieces strategies are made of, so that random lists reach deep into the parser.
fn strategy_value() -> impl Strategy<Value = Value> {
    // Every method, and a name that is none.
    let names = prop::sample::select(strata::strategy::METHODS.iter().copied().chain([""]).collect::<Vec<_>>());
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        "[a-zA-Z_0-9]{0,12}".prop_map(Value::from),
        prop::sample::select(vec!["bf16", "fp16", "FULL_SHARD", "HYBRID_SHARD", "BACKWARD_POST", "GptBlock"])
            .prop_map(Value::from),
    ];
    let config = leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "dtype",
                    "loss_scaler",
                    "sharding_strategy",
                    "mixed_precision",
                    "param_dtype",
                    "hybrid_shard_size",
                    "amax_history_len",
                    "interval",
                    "wrap_class",
                    "initial_scale_power",
                    "unknown",
                ])
                .prop_map(String::from),
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    let method = prop_oneof![names.clone().prop_map(Value::from), (names, config).prop_map(|(n, c)| json!([n, c])),];
    prop::collection::vec(method, 0..5).prop_map(Value::from)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn strategy_text_parses_or_fails_in_one_line(text in ".{0,200}") {
        if let Err(e) = StrataStrategy::parse(&text) {
            prop_assert!(one_line(&e), "{e}");
        }
    }

    #[test]
    fn strategy_lists_parse_validate_and_round_trip_or_fail_in_one_line(value in strategy_value()) {
        match StrataStrategy::from_value(&value) {
            Ok(s) => {
                prop_assert_eq!(StrataStrategy::from_value(&s.to_value()).unwrap(), s.clone());
                for world in [1, 2, 3, 8] {
                    if let Err(e) = strata::parallel::Mesh::new(&s, world, 0, world) {
                        prop_assert!(one_line(&e), "{e}");
                    }
                }
            }
            Err(e) => prop_assert!(one_line(&e), "{e}"),
        }
    }
}

fn mlp() -> (Engine, Optimizer) {
    let mut b = Builder::new();
    model::mlp(&MlpConfig { vocab: 16, layers: 2, dim: 8 }, &mut b).unwrap();
    let mut engine = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    (engine, optimizer)
}

/// A checkpoint of a small MLP whose parameters moved away from their initial values; the
/// path of its step folder and the units' saved values.
fn saved_checkpoint(root: &Path) -> (std::path::PathBuf, Vec<Tensor>) {
    let (mut engine, mut optimizer) = mlp();
    tch::no_grad(|| {
        for unit in engine.storage() {
            let _ = unit.flat.shallow_clone().f_add_scalar_(0.5).unwrap();
        }
    });
    let saved = engine.storage().iter().map(|u| u.flat.copy()).collect();
    let run = RunInfo {
        step: 3,
        world_size: 1,
        strategy: json!([]),
        optimizer: "adamw".into(),
        data: DataPosition { seed: 0, batch_size: 2, ctx: 4, next_step: 3 },
        loss_scaler: None,
        model: None,
        base: None,
    };
    (checkpoint::save(root, &mut engine, &mut optimizer, &run, None, 2).unwrap(), saved)
}

/// A change to a field of `meta.json` that a damaged or hand-edited file could hold.
#[derive(Clone, Debug)]
enum MetaEdit {
    UnitNumel(usize, i64),
    ExtraUnit(i64),
    DropUnit,
    Offset(usize, i64),
    Shape(usize, Vec<i64>),
    ParamUnit(usize, usize),
    OptimizerSteps(u64),
    Step(u64),
    Field(String, Value),
    Bytes(Vec<(usize, u8)>),
}

fn meta_edit() -> impl Strategy<Value = MetaEdit> {
    let big = prop_oneof![Just(i64::MAX), Just(i64::MIN), Just(-1i64), Just(1i64 << 40), 0..200i64];
    prop_oneof![
        (0..4usize, big.clone()).prop_map(|(i, v)| MetaEdit::UnitNumel(i, v)),
        big.clone().prop_map(MetaEdit::ExtraUnit),
        Just(MetaEdit::DropUnit),
        (0..8usize, big.clone()).prop_map(|(i, v)| MetaEdit::Offset(i, v)),
        (0..8usize, prop::collection::vec(big, 0..3)).prop_map(|(i, v)| MetaEdit::Shape(i, v)),
        (0..8usize, 0..6usize).prop_map(|(i, u)| MetaEdit::ParamUnit(i, u)),
        any::<u64>().prop_map(MetaEdit::OptimizerSteps),
        any::<u64>().prop_map(MetaEdit::Step),
        (prop::sample::select(vec!["files", "state_names", "fp8", "params", "format", "data"]), any::<i64>())
            .prop_map(|(k, v)| MetaEdit::Field(k.to_string(), json!(v))),
        prop::collection::vec((any::<usize>(), any::<u8>()), 1..6).prop_map(MetaEdit::Bytes),
    ]
}

/// The `i`-th (wrapping) element of the list under `key`.
fn nth<'a>(v: &'a mut Value, key: &str, i: usize) -> Option<&'a mut Value> {
    let list = v.get_mut(key)?.as_array_mut()?;
    let n = list.len().max(1);
    list.get_mut(i % n)
}

fn apply(meta: &[u8], edit: &MetaEdit) -> Vec<u8> {
    if let MetaEdit::Bytes(flips) = edit {
        let mut bytes = meta.to_vec();
        for (i, b) in flips {
            let n = bytes.len();
            bytes[i % n] = *b;
        }
        return bytes;
    }
    // Field edits apply to what still parses; bytes already damaged stay as they are.
    let Ok(mut v) = serde_json::from_slice::<Value>(meta) else { return meta.to_vec() };
    match edit {
        MetaEdit::UnitNumel(i, n) => {
            if let Some(u) = nth(&mut v, "unit_numel", *i) {
                *u = json!(n);
            }
        }
        MetaEdit::ExtraUnit(n) => {
            if let Some(list) = v.get_mut("unit_numel").and_then(Value::as_array_mut) {
                list.push(json!(n));
            }
        }
        MetaEdit::DropUnit => {
            if let Some(list) = v.get_mut("unit_numel").and_then(Value::as_array_mut) {
                list.pop();
            }
        }
        MetaEdit::Offset(i, o) => {
            if let Some(p) = nth(&mut v, "params", *i) {
                p["offset"] = json!(o);
            }
        }
        MetaEdit::Shape(i, s) => {
            if let Some(p) = nth(&mut v, "params", *i) {
                p["shape"] = json!(s);
            }
        }
        MetaEdit::ParamUnit(i, u) => {
            if let Some(p) = nth(&mut v, "params", *i) {
                p["unit"] = json!(u);
            }
        }
        MetaEdit::OptimizerSteps(s) => v["optimizer_steps"] = json!(s),
        MetaEdit::Step(s) => v["step"] = json!(s),
        MetaEdit::Field(k, value) => v[k.as_str()] = value.clone(),
        MetaEdit::Bytes(_) => {}
    }
    serde_json::to_vec(&v).unwrap()
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n != "meta.json"))
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    files.sort();
    files
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn a_damaged_meta_json_is_refused_or_restores_never_panics(edits in prop::collection::vec(meta_edit(), 1..4)) {
        let dir = tempfile::tempdir().unwrap();
        let (step, saved) = saved_checkpoint(dir.path());
        let meta_path = step.join("meta.json");
        let mut meta = std::fs::read(&meta_path).unwrap();
        for e in &edits {
            meta = apply(&meta, e);
        }
        std::fs::write(&meta_path, &meta).unwrap();
        let before = snapshot(&step);
        match Checkpoint::open(dir.path()) {
            Ok(ckpt) => {
                let (mut engine, mut optimizer) = mlp();
                match ckpt.restore(&mut engine, &mut optimizer, "adamw") {
                    Err(e) => prop_assert!(one_line(&e), "{e}"),
                    // What a damaged description lets through restores the saved values.
                    Ok(()) => {
                        for (unit, want) in engine.storage().iter().zip(&saved) {
                            prop_assert!(unit.flat.equal(want), "restored other values than were saved");
                        }
                    }
                }
            }
            Err(e) => prop_assert!(one_line(&e), "{e}"),
        }
        prop_assert_eq!(snapshot(&step), before, "reading a checkpoint changes no file");
    }
}

/// A safetensors file: 8-byte header length, the header, the data.
fn safetensors_bytes() -> impl Strategy<Value = Vec<u8>> {
    let dtype = prop::sample::select(vec!["F32", "F16", "BF16", "I64", "U8", "F64", "BOOL", "X9"]);
    let dim = prop_oneof![0..6u64, Just(u64::MAX), Just(1u64 << 40)];
    let entry = (
        prop::sample::select(vec!["layers.0.weight", "layers.0.bias", "embed.weight", "head.weight", "x"]),
        dtype,
        prop::collection::vec(dim, 0..3),
        (0..200u64, 0..200u64),
    );
    let structured = (prop::collection::vec(entry, 0..4), prop::collection::vec(any::<u8>(), 0..256), any::<bool>())
        .prop_map(|(entries, data, lie_about_length)| {
            let mut header = serde_json::Map::new();
            for (name, dtype, shape, (a, b)) in entries {
                header.insert(name.into(), json!({"dtype": dtype, "shape": shape, "data_offsets": [a, a + b]}));
            }
            let text = serde_json::to_vec(&Value::Object(header)).unwrap();
            let len = if lie_about_length { u64::MAX - 3 } else { text.len() as u64 };
            [len.to_le_bytes().to_vec(), text, data].concat()
        });
    prop_oneof![prop::collection::vec(any::<u8>(), 0..64), structured]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn safetensors_headers_load_or_fail_in_one_line(bytes in safetensors_bytes()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        if let Err(e) = strata::io::read_safetensors(&path) {
            prop_assert!(one_line(&e), "{e}");
        }
        let (mut engine, _) = mlp();
        if let Err(e) = strata::io::load_weights(&mut engine, &path) {
            prop_assert!(one_line(&e), "{e}");
        }
        prop_assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }
}
