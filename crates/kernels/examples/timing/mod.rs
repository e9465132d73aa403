//! How the speed examples time a call: the median of 10 calls, each timed with CUDA events on the
//! `Gpu`'s stream, after 3 warm-up calls (the first compiles the kernels).

use ladder_kernels::{Gpu, Result};

/// The median of 10 timed calls after 3 warm-up calls, in milliseconds.
pub fn median_ms(gpu: &Gpu, mut call: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        call()?;
    }
    let mut times = Vec::new();
    for _ in 0..10 {
        times.push(f64::from(gpu.time_ms(&mut call)?));
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
