//! How `ladder bench` times a case: deterministic inputs uploaded in enough sets to rotate
//! through when they fit in L2, one untimed (compiling) call, warm-up calls, then CUDA-event
//! samples of one or several calls each, and their median.

use std::time::Instant;

use ladder_compare::GpuRung;
use ladder_compare::gpu_rungs::Kernels;
use ladder_kernels::{Gpu, KernelError, Options, Output, Tensor};

use super::plan::Plan;

/// L2 cache of an H100/H200 (50 MB): inputs smaller than this are rotated.
const L2_BYTES: usize = 50 << 20;
/// A timed sample spans at least this long (several calls if needed).
const SAMPLE_MS: f64 = 1.0;

/// One set of inputs: Q, K, V, and dO when a backward pass is timed.
pub(super) struct InputSet {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Option<Tensor>,
}

/// One call of a case on input set `i`; returns what it allocated so that it is freed after the
/// sample, outside the timed region.
pub(super) type Step<'a> = Box<dyn FnMut(usize) -> ladder_kernels::Result<Vec<Tensor>> + 'a>;

/// Prepare a case of `rung` on `sets` (for a backward pass: the forward outputs it needs,
/// untimed); the step then runs one call on input set `i`.
pub(super) fn step<'a>(
    rung: GpuRung,
    gpu: &'a Gpu,
    sets: &'a [InputSet],
    opts: Options,
) -> ladder_kernels::Result<Step<'a>> {
    match rung.kernels() {
        Kernels::Forward(forward) => Ok(Box::new(move |i| {
            let s = &sets[i];
            let out = forward(gpu, &s.q, &s.k, &s.v, &opts)?;
            Ok(vec![out.o, out.lse])
        })),
        Kernels::Backward { forward, backward, deterministic } => {
            let opts = Options { deterministic, ..opts };
            let outs: Vec<Output> = sets
                .iter()
                .map(|s| forward(gpu, &s.q, &s.k, &s.v, &opts))
                .collect::<ladder_kernels::Result<_>>()?;
            Ok(Box::new(move |i| {
                let (s, out) = (&sets[i], &outs[i]);
                let d_o = s.d_o.as_ref().ok_or_else(|| {
                    KernelError::Shape("no dO uploaded for a backward case".into())
                })?;
                let g = backward(gpu, &s.q, &s.k, &s.v, out, d_o, &opts)?;
                Ok(vec![g.dq, g.dk, g.dv])
            }))
        }
    }
}

/// Deterministic pseudo-random inputs in [-1, 1), generated once per slot and length and reused
/// across cases (every default case has tokens × hidden elements per tensor).
#[derive(Default)]
pub(super) struct HostPool {
    slots: Vec<Vec<f32>>,
}

impl HostPool {
    pub(super) fn values(&mut self, slot: usize, len: usize) -> &[f32] {
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, Vec::new);
        }
        if self.slots[slot].len() != len {
            let mut state =
                0x9e37_79b9_7f4a_7c15u64 ^ (slot as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            self.slots[slot] = (0..len)
                .map(|_| {
                    // splitmix64
                    state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    z ^= z >> 31;
                    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect();
        }
        &self.slots[slot]
    }
}

/// How many input sets to rotate among so that they do not all sit in L2.
fn sets_for(bytes_per_set: usize) -> usize {
    if bytes_per_set >= L2_BYTES {
        1
    } else {
        (2 * L2_BYTES).div_ceil(bytes_per_set.max(1)).clamp(2, 32)
    }
}

pub(super) fn upload_sets(
    gpu: &Gpu,
    pool: &mut HostPool,
    plan: &Plan,
    d: usize,
    n: usize,
    with_d_o: bool,
) -> ladder_kernels::Result<Vec<InputSet>> {
    let (batch, heads) = plan.dims(d, n);
    let shape = [batch, heads, n, d];
    let len = batch * heads * n * d;
    let tensors = if with_d_o { 4 } else { 3 };
    let sets = sets_for(tensors * len * plan.dtype.size());
    (0..sets)
        .map(|s| {
            let mut up =
                |role: usize| gpu.upload(pool.values(4 * s + role, len), &shape, plan.dtype);
            Ok(InputSet {
                q: up(0)?,
                k: up(1)?,
                v: up(2)?,
                d_o: if with_d_o { Some(up(3)?) } else { None },
            })
        })
        .collect()
}

/// The median time of one case.
pub(super) struct Timing {
    pub(super) ms: f64,
    pub(super) samples: usize,
    pub(super) calls_per_sample: usize,
    /// Wall time of the untimed first call (kernel compilation or cache load included).
    pub(super) first_call_s: f64,
}

pub(super) fn measure(
    gpu: &Gpu,
    step: &mut Step<'_>,
    sets: usize,
    warmup: usize,
    repeats: usize,
    budget_ms: f64,
) -> ladder_kernels::Result<Timing> {
    let mut next = 0;
    let mut call = |keep: &mut Vec<Vec<Tensor>>| -> ladder_kernels::Result<()> {
        keep.push(step(next % sets)?);
        next += 1;
        Ok(())
    };
    // The first call compiles the kernel (or loads it from the disk cache): not timed.
    let first = Instant::now();
    call(&mut Vec::new())?;
    gpu.synchronize()?;
    let first_call_s = first.elapsed().as_secs_f64();
    let mut single = f64::INFINITY;
    for _ in 0..warmup {
        let mut keep = Vec::new();
        let ms = gpu.time_ms(|| call(&mut keep))?;
        single = single.min(f64::from(ms));
    }
    let calls = ((SAMPLE_MS / single.max(1e-4)).ceil() as usize).clamp(1, 64);
    let mut samples = Vec::with_capacity(repeats);
    let mut total = 0.0;
    for _ in 0..repeats {
        let mut keep = Vec::with_capacity(calls);
        let ms = f64::from(gpu.time_ms(|| (0..calls).try_for_each(|_| call(&mut keep)))?);
        drop(keep); // freed after the end event, in stream order
        samples.push(ms / calls as f64);
        total += ms;
        if total > budget_ms {
            break;
        }
    }
    samples.sort_by(f64::total_cmp);
    let mid = samples.len() / 2;
    let ms =
        if samples.len() % 2 == 1 { samples[mid] } else { (samples[mid - 1] + samples[mid]) / 2.0 };
    Ok(Timing { ms, samples: samples.len(), calls_per_sample: calls, first_call_s })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_rotate_only_when_they_fit_in_l2() {
        // Default shapes: 16k tokens × 2048 × 2 bytes = 64 MiB per tensor.
        assert_eq!(sets_for(3 * 16384 * 2048 * 2), 1);
        assert_eq!(sets_for(10 << 20), 10);
        assert_eq!(sets_for(1), 32);
    }

    #[test]
    fn host_inputs_are_deterministic_and_in_range() {
        let mut pool = HostPool::default();
        let a = pool.values(3, 1000).to_vec();
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.1, "{mean}");
        assert_ne!(a, pool.values(2, 1000));
        assert_eq!(a, HostPool::default().values(3, 1000));
    }
}
