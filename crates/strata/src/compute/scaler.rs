//! The loss scaler of fp16 training, configured as PatrickStar's `fp16` section: a static
//! scale, or a dynamic one that halves on overflow (after `hysteresis` overflows) and
//! doubles after `loss_scale_window` steps without one.
//!
//! Owns the scale and its rule, and what a step's gradients get from their global norm
//! (`GradScaling::decide`: unscaling, the overflow check, the clipping factor). Must not
//! scale losses or read gradients: the training step does both, handing over the norm.
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// The loss scaler's settings (PatrickStar's `fp16` section); the default is a dynamic scale.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossScalerConfig {
    /// 0 for a dynamic scale; any other value is a static scale (no overflow check).
    pub loss_scale: f64,
    /// A dynamic scale starts at 2^this.
    pub initial_scale_power: u32,
    /// Steps without overflow before the scale doubles.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves.
    pub hysteresis: u32,
    /// The floor a dynamic scale never halves below.
    pub min_loss_scale: f64,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        LossScalerConfig {
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            min_loss_scale: 1.0,
        }
    }
}

impl LossScalerConfig {
    /// Checks the settings: `loss_scale` finite and not negative, a positive window,
    /// hysteresis and `min_loss_scale`, and `initial_scale_power` at most 126.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("loss scaler: {m}")));
        if !(self.loss_scale.is_finite() && self.loss_scale >= 0.0) {
            return bad(format!("loss_scale must be 0 (dynamic) or positive, got {}", self.loss_scale));
        }
        if self.loss_scale_window == 0 || self.hysteresis == 0 {
            return bad("loss_scale_window and hysteresis must be positive".into());
        }
        if !(self.min_loss_scale.is_finite() && self.min_loss_scale > 0.0) || self.initial_scale_power > 126 {
            return bad("min_loss_scale must be positive and initial_scale_power at most 126".into());
        }
        Ok(())
    }
}

/// The scaler's state, saved in checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The rule the scale follows.
    pub config: LossScalerConfig,
    /// The factor the loss is multiplied by now.
    pub scale: f64,
    /// Overflows still tolerated before the next halving.
    pub hysteresis_left: u32,
    /// Steps since the last overflow (or since the last doubling).
    pub good_steps: u64,
    /// Overflowed steps so far (each skipped).
    pub overflows: u64,
}

impl LossScaler {
    /// A scaler at its starting scale: the static one, or 2^`initial_scale_power`.
    pub fn new(config: LossScalerConfig) -> Result<LossScaler> {
        config.validate()?;
        let scale =
            if config.loss_scale > 0.0 { config.loss_scale } else { 2f64.powi(config.initial_scale_power as i32) };
        let hysteresis_left = config.hysteresis;
        Ok(LossScaler { config, scale, hysteresis_left, good_steps: 0, overflows: 0 })
    }

    /// Why the saved state cannot be resumed from, if it cannot.
    pub fn check(&self) -> Result<()> {
        self.config.validate()?;
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(Error::Config(format!("loss scaler: a scale of {}", self.scale)));
        }
        Ok(())
    }

    /// Continues from `saved`'s state (its scale, overflows and the steps since the last
    /// change) under this run's configuration, which may differ from the saved one's: the
    /// tolerated overflows and the clean steps are kept within this configuration's counts.
    pub fn resume_from(&mut self, saved: &LossScaler) -> Result<()> {
        saved.check()?;
        if self.is_dynamic() {
            self.scale = saved.scale.max(self.config.min_loss_scale);
        }
        self.hysteresis_left = saved.hysteresis_left.clamp(1, self.config.hysteresis);
        self.good_steps = saved.good_steps.min(self.config.loss_scale_window - 1);
        self.overflows = saved.overflows;
        Ok(())
    }

    /// Whether gradients are checked for inf/NaN (a dynamic scale).
    pub fn is_dynamic(&self) -> bool {
        self.config.loss_scale == 0.0
    }

    /// Records one step: `overflow` says whether its gradients were not finite (the step
    /// was skipped). A dynamic scale halves once the tolerated overflows are used up, and
    /// doubles after a window of clean steps.
    pub fn update(&mut self, overflow: bool) {
        if !self.is_dynamic() {
            return;
        }
        if overflow {
            self.overflows += 1;
            self.good_steps = 0;
            if self.hysteresis_left > 1 {
                self.hysteresis_left -= 1;
            } else {
                self.scale = (self.scale / 2.0).max(self.config.min_loss_scale);
            }
            return;
        }
        self.good_steps += 1;
        if self.good_steps == self.config.loss_scale_window {
            self.scale *= 2.0;
            self.good_steps = 0;
            self.hysteresis_left = self.config.hysteresis;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_scale_halves_after_hysteresis_and_doubles_after_a_clean_window() {
        let config =
            LossScalerConfig { initial_scale_power: 4, loss_scale_window: 3, hysteresis: 2, ..Default::default() };
        let mut s = LossScaler::new(config).unwrap();
        assert_eq!(s.scale, 16.0);
        s.update(true);
        assert_eq!(s.scale, 16.0, "the first overflow is tolerated");
        s.update(true);
        assert_eq!(s.scale, 8.0);
        s.update(true);
        assert_eq!(s.scale, 4.0, "tolerance stays used up until the scale grows again");
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!((s.scale, s.hysteresis_left), (8.0, 2));
        for _ in 0..20 {
            s.update(true);
        }
        assert_eq!(s.scale, 1.0, "never below min_loss_scale");
        let mut fixed = LossScaler::new(LossScalerConfig { loss_scale: 128.0, ..Default::default() }).unwrap();
        fixed.update(true);
        assert_eq!((fixed.scale, fixed.is_dynamic()), (128.0, false));
        assert!(LossScaler::new(LossScalerConfig { hysteresis: 0, ..Default::default() }).is_err());
    }
}

/// How gradients are scaled and checked before the update (`amp_native`).
#[derive(Clone, Debug, Default)]
pub struct GradScaling {
    /// Scale the loss before backward and unscale the gradients after.
    pub scaler: Option<LossScaler>,
    /// Check the gradients for inf/NaN and skip such steps (a dynamic scaler always does).
    pub skip_if_nonfinite: bool,
}

/// What a step's gradients get before the update.
pub(crate) struct GradDecision {
    /// Multiplies the gradients: unscaling and clipping together.
    pub factor: f64,
    /// The global norm before clipping, where clipping is on.
    pub grad_norm: Option<f64>,
    /// The gradients were not finite and the scaling says to skip the update.
    pub skipped: bool,
}

impl GradScaling {
    /// Continues the loss scale a checkpoint saved (`saved`), where both it and this run
    /// scale their loss.
    pub fn resume_from(&mut self, saved: Option<&LossScaler>) -> Result<()> {
        match (saved, &mut self.scaler) {
            (Some(saved), Some(scaler)) => scaler.resume_from(saved),
            _ => Ok(()),
        }
    }

    /// Whether a step with `grad_clip` updates whatever its gradients are (no clipping, no
    /// scaling, no check), so an update may start before the whole step's gradients exist.
    pub fn updates_unconditionally(&self, grad_clip: Option<f64>) -> bool {
        grad_clip.is_none() && self.scaler.is_none() && !self.skip_if_nonfinite
    }

    /// The loss scale of the coming step (1 without a scaler).
    pub fn scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale)
    }

    /// Unscales, checks and clips gradients computed from a loss scaled by `scale`, from
    /// their global squared norm (`sq_norm`, computed only where needed), and moves the
    /// scaler on.
    pub(crate) fn decide(
        &mut self,
        grad_clip: Option<f64>,
        scale: f64,
        sq_norm: impl FnOnce() -> Result<f64>,
    ) -> Result<GradDecision> {
        let check = self.skip_if_nonfinite || self.scaler.as_ref().is_some_and(LossScaler::is_dynamic);
        let mut decision = GradDecision { factor: 1.0, grad_norm: None, skipped: false };
        if check || scale != 1.0 || grad_clip.is_some() {
            let norm = sq_norm()?.sqrt() / scale;
            decision.skipped = check && !norm.is_finite();
            if !decision.skipped {
                decision.factor = grad_clip.map_or(1.0, |max| clip_coefficient(max, norm)) / scale;
                decision.grad_norm = grad_clip.map(|_| norm);
            }
        }
        if let Some(s) = &mut self.scaler {
            s.update(decision.skipped);
        }
        Ok(decision)
    }
}

/// The factor that brings gradients of global norm `norm` down to `max_norm` (1 when they
/// are within it), as `clip_grad_norm_` computes it.
pub fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}
