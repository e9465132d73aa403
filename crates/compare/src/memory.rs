//! The extra heap memory a rung allocates, measured by a counting global allocator.
//!
//! A binary that wants the figure installs the allocator once:
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOC: ladder_compare::memory::PeakAlloc = ladder_compare::memory::PeakAlloc;
//!
//! fn main() {
//!     let run = ladder_compare::memory::measure(|| vec![0u8; 1 << 20]);
//!     println!("{:?} extra bytes", run.peak_bytes);
//! }
//! ```
//!
//! The counters are process-wide, so measure one thing at a time.

use std::time::{Duration, Instant};

pub use peak_alloc::PeakAlloc;

/// A result with the time it took and the heap it needed.
#[derive(Debug, Clone)]
pub struct Measured<R> {
    pub value: R,
    pub elapsed: Duration,
    /// Peak heap bytes in use during the call beyond those in use before it (`None` when the
    /// counting allocator is not installed).
    pub peak_bytes: Option<u64>,
}

/// Runs `f`, timing it and recording its peak extra heap use.
pub fn measure<R>(f: impl FnOnce() -> R) -> Measured<R> {
    let installed = PeakAlloc.current_usage() > 0;
    let before = PeakAlloc.current_usage();
    PeakAlloc.reset_peak_usage();
    let start = Instant::now();
    let value = f();
    let elapsed = start.elapsed();
    let peak_bytes = installed.then(|| PeakAlloc.peak_usage().saturating_sub(before) as u64);
    Measured { value, elapsed, peak_bytes }
}

/// Bytes as a short human-readable string (`"12.0 MiB"`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}
