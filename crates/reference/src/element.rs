//! The number types a rung can run in.

use std::fmt::{Debug, Display};
use std::iter::Sum;

use ndarray::{LinalgScalar, ScalarOperand};
use num_traits::Float;

/// A floating-point type the rungs compute in: `f32` (the precision under test) or `f64` (the
/// oracle, and the precision in which every rung must agree with the oracle to rounding).
pub trait Element:
    Float + LinalgScalar + ScalarOperand + Send + Sync + Debug + Display + Sum + 'static
{
    /// `"f32"` or `"f64"`.
    const NAME: &'static str;
    /// Unit roundoff of the type (half the distance from 1 to the next number).
    const UNIT_ROUNDOFF: f64;

    /// Converts from `f64`, rounding to nearest.
    fn of(x: f64) -> Self;
    /// Converts to `f64` exactly.
    fn as_f64(self) -> f64;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    const UNIT_ROUNDOFF: f64 = f32::EPSILON as f64 / 2.0;

    fn of(x: f64) -> Self {
        x as f32
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
}

impl Element for f64 {
    const NAME: &'static str = "f64";
    const UNIT_ROUNDOFF: f64 = f64::EPSILON / 2.0;

    fn of(x: f64) -> Self {
        x
    }
    fn as_f64(self) -> f64 {
        self
    }
}
