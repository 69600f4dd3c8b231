//! Data parallelism's unused-parameter policy, on a one-rank job in this process.
use std::sync::Arc;
use std::time::Duration;
use strata::comm::{Comm, Store, StoreServer};
use strata::data::{Batch, Step};
use strata::engine::{Engine, EngineConfig};
use strata::model::{Builder, Init, ParamId, Params, TpRole, Unit};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{DataParallel, DataParallelOptions};
use strata::train::Trainer;
use tch::{Kind, Tensor};

/// Token ids to logits through one table; `spare` is declared but never read.
struct Lookup {
    table: ParamId,
}

impl Unit for Lookup {
    fn kind(&self) -> &'static str {
        "Lookup"
    }
    fn forward(&self, p: &Params<'_>, tokens: &Tensor) -> strata::Result<Tensor> {
        Ok(Tensor::f_embedding(&p[self.table], tokens, -1, false, false)?)
    }
}

fn trainer(find_unused_parameters: bool) -> Trainer {
    let mut b = Builder::new();
    let mut u = b.unit("lookup");
    let table = u.param("lookup.weight", &[5, 5], Init::Normal { std: 0.1 }, TpRole::Replicated);
    u.param("spare.weight", &[3], Init::Zeros, TpRole::Replicated);
    u.finish(Lookup { table });
    let mut engine = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").unwrap();
    let store = Store::connect(server.addr(), "t", Duration::from_secs(10)).unwrap();
    let comm = Comm::new(store, Some(server), 0, 1, "cpu:tcp", Duration::from_secs(10)).unwrap();
    let options = DataParallelOptions { find_unused_parameters, ..Default::default() };
    DataParallel::install(&mut engine, Arc::from(comm.world().unwrap()), None, options).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    Trainer::new(engine, optimizer, LrSchedule::Constant, None)
}

fn step() -> Step {
    let inputs = Tensor::from_slice(&[0i64, 1, 2, 3]).view([2, 2]);
    let targets = Tensor::from_slice(&[1i64, 2, 3, 4]).view([2, 2]).to_kind(Kind::Int64);
    Step::new(0, vec![Batch::new(inputs, targets).unwrap()])
}

#[test]
fn a_parameter_without_gradient_is_named_unless_expected() {
    let err = trainer(false).train_step(&step()).expect_err("an unused parameter fails the step");
    let text = err.to_string();
    assert!(text.contains("spare.weight") && !text.contains("lookup.weight"), "{text}");
    assert!(text.contains("find_unused_parameters"), "{text}");
    let mut allowed = trainer(true);
    let before = allowed.engine().param_by_name("lookup.weight").unwrap().copy();
    let losses: Vec<f64> = (0..3).map(|_| allowed.train_step(&step()).unwrap().loss).collect();
    // The used table trains (its loss falls); the spare parameter, with no gradient, keeps
    // its zeros.
    assert!(losses[2] < losses[0], "{losses:?}");
    assert!(!allowed.engine().param_by_name("lookup.weight").unwrap().equal(&before));
    assert_eq!(allowed.engine().param_by_name("spare.weight").unwrap().abs().sum(Kind::Double).double_value(&[]), 0.0);
}
