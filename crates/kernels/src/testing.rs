//! For tests that need a GPU: skip cleanly without one, fail when one is required.

use crate::gpu::Gpu;

/// The GPU for a test, or `None` (with a printed notice) when there is none.
///
/// # Panics
///
/// When `LADDER_REQUIRE_GPU=1` is set and no GPU can be opened: a GPU test must fail, not skip,
/// where a GPU is promised.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::new() {
        Ok(gpu) => {
            gpu.set_poison_outputs(true);
            gpu.set_sync_launches(true);
            Some(gpu)
        }
        Err(e) => {
            if required() {
                panic!("{test}: LADDER_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("{test}: skipped (no GPU: {e})");
            None
        }
    }
}

/// Whether `LADDER_REQUIRE_GPU=1` is set.
pub fn required() -> bool {
    std::env::var("LADDER_REQUIRE_GPU").is_ok_and(|v| v == "1")
}
