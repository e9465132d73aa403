//! # ladder-compare: the attention ladder, checked rung by rung
//!
//! - [`mod@check`]: check your own attention implementation against the float64 oracle, with the
//!   ladder's case space, tolerances and shrinking (the equivalence suite uses it too);
//! - [`metrics`]: error against the float64 oracle and the tolerances derived from it;
//! - [`mod@cases`]: the proptest strategies that draw random attention problems;
//! - [`rungs`]: every rung by name, behind one call;
//! - [`modifiers`]: the score modifiers by name (softcap, ALiBi, a relative bias), CPU and GPU forms;
//! - [`oracle`]: the float64 oracle and the per-case tolerances the suite checks against;
//! - [`verify`]: the table `ladder verify` prints;
//! - [`npy`]: `.npy` input and output for `ladder run`;
//! - [`memory`]: the extra heap memory a rung allocates;
//! - [`gpu_rungs`]: every GPU kernel by name ([`GpuRung`]), and [`gpu_check`]: running and judging them;
//! - [`results`]: the benchmark results files (`bench.csv`, `peers.csv`, `meta.json`).

pub mod cases;
pub mod check;
pub mod gpu_check;
pub mod gpu_rungs;
pub mod low_precision;
pub mod memory;
pub mod metrics;
pub mod modifiers;
pub mod npy;
pub mod oracle;
pub mod packed;
pub mod results;
pub mod rungs;
pub mod verify;

pub use cases::{Case, CaseSpace, Inputs, cases};
pub use gpu_rungs::GpuRung;
pub use metrics::{ErrorStats, Tolerance, error};
pub use rungs::{Rung, RungConfig};
