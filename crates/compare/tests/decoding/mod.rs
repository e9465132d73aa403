//! What the GPU decoding tests share (`gpu_decode.rs`, `gpu_decode_varlen.rs`): a decoding call's
//! case (shapes, lengths, element type, seed), its inputs on the host and the device in every
//! cache and memory layout, the launch, and the per-sequence oracle. Each test binary uses a
//! part of it.
#![allow(dead_code)]

use ladder_compare::Inputs;
use ladder_compare::cases::{permutation, pseudo_random};
use ladder_compare::gpu_check::{self, Layout as Axes, shared_gpu};
use ladder_compare::oracle::{Expected, Oracle};
use ladder_kernels::decode::{
    self, Cache, DecodeOptions, DecodeStats, KvCache, PageTable, PagedKvCache,
    Strategy as DecodeStrategy,
};
use ladder_kernels::{DType, Gpu, Output, Tensor, round_to};
use ladder_reference::{AttentionOptions, AttentionOutput};
use ndarray::{Array3, Array4, s};

pub fn gpu() -> Option<&'static Gpu> {
    shared_gpu("GPU decode tests")
}

/// The head dimensions this GPU runs (d = 256 needs more shared memory per block than sm_86,
/// sm_89 and sm_120 give: `decode::head_dim_fits`).
pub fn head_dims() -> Vec<usize> {
    let fits = |d: &usize| gpu().is_none_or(|g| decode::head_dim_fits(g, *d));
    decode::HEAD_DIMS.iter().copied().filter(fits).collect()
}

/// One decoding call: shapes, lengths and element type.
#[derive(Clone, Debug)]
pub struct Case {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub n_new: usize,
    pub d: usize,
    pub capacity: usize,
    pub lengths: Vec<usize>,
    pub dtype: DType,
    pub seed: u64,
}

/// How the cache reaches the kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// `[batch, heads_kv, capacity, d]`.
    Contiguous,
    /// Pages of `page` tokens in shuffled order; the table uploaded with its host copy (checked
    /// at every call) or wrapped from a device buffer (`device_only`: not checked on the host).
    Paged { page: usize, device_only: bool },
}

/// The host copies of a case's inputs, rounded to its dtype (the cache NaN past each length).
pub struct HostInputs {
    pub q: Array4<f32>,
    pub k: Array4<f32>,
    pub v: Array4<f32>,
}

impl Case {
    pub fn batch(&self) -> usize {
        self.lengths.len()
    }

    pub fn inputs(&self) -> HostInputs {
        let (b, hq, hkv, n, d, cap) =
            (self.batch(), self.heads_q, self.heads_kv, self.n_new, self.d, self.capacity);
        let q = pseudo_random(self.seed, b * hq * n * d);
        let mut k = pseudo_random(self.seed + 1, b * hkv * cap * d);
        let mut v = pseudo_random(self.seed + 2, b * hkv * cap * d);
        // Entries past each sequence's length must never be read.
        for (bi, &len) in self.lengths.iter().enumerate() {
            for h in 0..hkv {
                let start = ((bi * hkv + h) * cap + len) * d;
                let end = ((bi * hkv + h) * cap + cap) * d;
                k[start..end].fill(f32::NAN);
                v[start..end].fill(f32::NAN);
            }
        }
        let arr = |x: Vec<f32>, shape: [usize; 4]| {
            Array4::from_shape_vec(shape, round_to(&x, self.dtype)).expect("shape")
        };
        HostInputs {
            q: arr(q, [b, hq, n, d]),
            k: arr(k, [b, hkv, cap, d]),
            v: arr(v, [b, hkv, cap, d]),
        }
    }

    /// The softmax scale as the kernel gets it, and the oracle's options with the same `f32`.
    pub fn options(&self) -> (AttentionOptions, f32) {
        let (attention, opts) = gpu_check::options(&AttentionOptions::causal(), self.d);
        (attention, opts.scale.expect("options() sets the scale"))
    }

    /// The call's options: the case's scale, `strategy`, `splits` and `φ` (the default window).
    pub fn decode_options(
        &self,
        strategy: DecodeStrategy,
        splits: Option<usize>,
        phi: f32,
    ) -> DecodeOptions {
        DecodeOptions {
            scale: Some(self.options().1),
            splits,
            strategy,
            phi,
            ..DecodeOptions::default()
        }
    }

    /// What the heuristics see of the case (`paged` or not).
    pub fn workload(&self, paged: bool) -> decode::Workload {
        decode::Workload {
            rows_per_kv_head: self.heads_q / self.heads_kv * self.n_new,
            max_len: self.lengths.iter().copied().max().unwrap_or(0),
            batch_heads_kv: self.batch() * self.heads_kv,
            head_dim: self.d,
            paged,
        }
    }

    /// The split count the kernel uses for `splits` (the heuristic's when `None`).
    pub fn splits_used(&self, gpu: &Gpu, splits: Option<usize>, paged: bool) -> usize {
        splits.unwrap_or_else(|| {
            decode::default_splits(&self.workload(paged), gpu.sm_count() as usize)
        })
    }
}

/// A case's cache in pages: K and V `[num_pages, heads_kv, page, d]` and the page table.
pub struct HostPages {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub shape: [usize; 4],
    pub entries: Vec<i32>,
    pub max_pages: usize,
}

/// The contiguous cache of `x` cut into pages of `page` tokens: sequence `b` gets
/// `ceil(capacity / page)` pages, all pages (and three spare ones) handed out in a shuffled order,
/// so a sequence's pages are scattered. Slots past the capacity, and the spare pages, are NaN;
/// the table's entries past the pages a sequence's length needs are −1 (they must not be read).
pub fn paginate(case: &Case, x: &HostInputs, page: usize) -> HostPages {
    let (b, hkv, cap, d) = (case.batch(), case.heads_kv, case.capacity, case.d);
    let max_pages = cap.div_ceil(page);
    let num_pages = b * max_pages + 3;
    let order = permutation(case.seed ^ page as u64, num_pages);
    let shape = [num_pages, hkv, page, d];
    let mut k = vec![f32::NAN; num_pages * hkv * page * d];
    let mut v = k.clone();
    let mut entries = vec![-1i32; b * max_pages];
    for bi in 0..b {
        for i in 0..max_pages {
            let p = order[bi * max_pages + i];
            if i < case.lengths[bi].div_ceil(page) {
                entries[bi * max_pages + i] = p as i32;
            }
            for h in 0..hkv {
                for slot in 0..page {
                    let j = i * page + slot;
                    if j >= cap {
                        break;
                    }
                    let dst = ((p * hkv + h) * page + slot) * d;
                    let src = x.k.slice(s![bi, h, j, ..]);
                    k[dst..dst + d].iter_mut().zip(src).for_each(|(o, &i)| *o = i);
                    let src = x.v.slice(s![bi, h, j, ..]);
                    v[dst..dst + d].iter_mut().zip(src).for_each(|(o, &i)| *o = i);
                }
            }
        }
    }
    HostPages { k, v, shape, entries, max_pages }
}

/// A case's tensors on the device, in one layout.
pub struct Device {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub table: Option<PageTable>,
}

impl Device {
    pub fn cache<'a>(&'a self, lengths: &'a [usize]) -> Cache<'a> {
        match &self.table {
            None => KvCache { k: &self.k, v: &self.v, lengths }.into(),
            Some(page_table) => {
                PagedKvCache { k_pages: &self.k, v_pages: &self.v, page_table, lengths }.into()
            }
        }
    }
}

pub fn upload_values(gpu: &Gpu, values: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    gpu.upload(values, shape, dtype).expect("upload")
}

/// Upload a table of `entries` as `layout` asks: with its host copy, or wrapped from a device
/// buffer.
pub fn upload_table(gpu: &Gpu, entries: &[i32], batch: usize, device_only: bool) -> PageTable {
    let max_pages = entries.len() / batch;
    if device_only {
        let buf = gpu.stream().clone_htod(entries).expect("upload the table");
        PageTable::from_cuda_slice(buf, batch, max_pages).expect("table")
    } else {
        PageTable::upload(gpu, entries, batch, max_pages).expect("table")
    }
}

pub fn upload(gpu: &Gpu, case: &Case, x: &HostInputs, layout: Layout) -> Device {
    upload_as(gpu, case, x, layout, Axes::Bhsd)
}

/// [`upload`] with Q and the cache laid out as `axes` says: row-major, `[b, s, h, d]` in memory
/// (a projection's Q, FlashAttention's `k_cache`, vLLM's NHD pages) or slot 0 of a packed buffer
/// whose other slots are NaN. The kernels see the same logical tensors.
pub fn upload_as(gpu: &Gpu, case: &Case, x: &HostInputs, layout: Layout, axes: Axes) -> Device {
    let put = |a: &Array4<f32>| {
        gpu_check::upload_in(gpu, &a.mapv(f64::from), case.dtype, axes).expect("upload")
    };
    let q = put(&x.q);
    match layout {
        Layout::Contiguous => Device { q, k: put(&x.k), v: put(&x.v), table: None },
        Layout::Paged { page, device_only } => {
            let HostPages { k, v, shape, entries, .. } = paginate(case, x, page);
            let arr = |v: Vec<f32>| Array4::from_shape_vec(shape, v).expect("pages");
            Device {
                q,
                k: put(&arr(k)),
                v: put(&arr(v)),
                table: Some(upload_table(gpu, &entries, case.batch(), device_only)),
            }
        }
    }
}

/// One FlashDecoding call on `dev` with `splits`.
pub fn launch(gpu: &Gpu, case: &Case, dev: &Device, splits: Option<usize>) -> Output {
    launch_with(gpu, case, dev, &case.decode_options(DecodeStrategy::FlashDecoding, splits, 0.0)).0
}

/// One call on `dev` with `opts`, and what it did.
pub fn launch_with(
    gpu: &Gpu,
    case: &Case,
    dev: &Device,
    opts: &DecodeOptions,
) -> (Output, DecodeStats) {
    decode::forward_with_stats(gpu, &dev.q, dev.cache(&case.lengths), opts)
        .unwrap_or_else(|e| panic!("{case:?} {opts:?}: {e}"))
}

/// `O` and `lse` on the host.
pub fn to_host(case: &Case, out: &Output) -> (Array4<f32>, Array3<f32>) {
    let (b, hq, n, d) = (case.batch(), case.heads_q, case.n_new, case.d);
    let o = Array4::from_shape_vec((b, hq, n, d), out.o.to_f32_vec().expect("copy")).expect("o");
    let lse = Array3::from_shape_vec((b, hq, n), out.lse.to_f32_vec().expect("copy")).expect("lse");
    (o, lse)
}

/// Runs the kernel on `x` in `layout` with `splits`; returns `O` and `lse` on the host.
pub fn run(
    gpu: &Gpu,
    case: &Case,
    x: &HostInputs,
    layout: Layout,
    splits: Option<usize>,
) -> (Array4<f32>, Array3<f32>) {
    run_as(gpu, case, x, layout, Axes::Bhsd, splits)
}

/// [`run`] with the inputs laid out as `axes` says ([`upload_as`]).
pub fn run_as(
    gpu: &Gpu,
    case: &Case,
    x: &HostInputs,
    layout: Layout,
    axes: Axes,
    splits: Option<usize>,
) -> (Array4<f32>, Array3<f32>) {
    to_host(case, &launch(gpu, case, &upload_as(gpu, case, x, layout, axes), splits))
}

/// Sequence `b`'s problem (its new tokens against its first `len` keys, in `f64`) and oracle.
pub fn problem_of(case: &Case, x: &HostInputs, b: usize) -> (Inputs<f64>, Oracle) {
    problem_of_tokens(case, x, b, case.n_new)
}

/// [`problem_of`] for the first `n` of sequence `b`'s new tokens (packed new tokens, where each
/// sequence has its own count).
pub fn problem_of_tokens(case: &Case, x: &HostInputs, b: usize, n: usize) -> (Inputs<f64>, Oracle) {
    problem_with(case, x, b, n, &case.options().0)
}

/// [`problem_of_tokens`] under `attention` (the case's causal mask and scale, with modifiers).
pub fn problem_with(
    case: &Case,
    x: &HostInputs,
    b: usize,
    n: usize,
    attention: &AttentionOptions,
) -> (Inputs<f64>, Oracle) {
    let len = case.lengths[b];
    let wide = |a: ndarray::ArrayView4<f32>| a.mapv(f64::from);
    let q = wide(x.q.slice(s![b..b + 1, .., ..n, ..]));
    let inputs = Inputs {
        d_o: Array4::zeros(q.dim()),
        q,
        k: wide(x.k.slice(s![b..b + 1, .., ..len, ..])),
        v: wide(x.v.slice(s![b..b + 1, .., ..len, ..])),
    };
    let oracle = Oracle::new(&inputs, attention).expect("oracle");
    (inputs, oracle)
}

/// The oracle and the GPU kernel's tolerances for sequence `b`.
pub fn expected_for(case: &Case, x: &HostInputs, b: usize) -> Expected {
    let (inputs, oracle) = problem_of(case, x, b);
    gpu_check::expected_forward(&oracle, &inputs, case.dtype).expect("tolerance")
}

pub fn sequence(o: &Array4<f32>, lse: &Array3<f32>, b: usize) -> AttentionOutput<f32> {
    AttentionOutput {
        o: o.slice(s![b..b + 1, .., .., ..]).to_owned(),
        lse: lse.slice(s![b..b + 1, .., ..]).to_owned(),
        stats: Default::default(),
    }
}

/// A sequence without keys: `O = 0` and `lse = −∞` exactly.
pub fn assert_empty(what: &str, o: &Array4<f32>, lse: &Array3<f32>, b: usize) {
    let seq = sequence(o, lse, b);
    assert!(seq.o.iter().all(|&v| v == 0.0), "{what}, sequence {b}: O ≠ 0");
    assert!(seq.lse.iter().all(|&v| v == f32::NEG_INFINITY), "{what}, sequence {b}: lse ≠ −inf");
}

pub fn cases(dtype: DType) -> Vec<Case> {
    let case = |heads_q, heads_kv, n_new, d, capacity, lengths: &[usize], seed| Case {
        heads_q,
        heads_kv,
        n_new,
        d,
        capacity,
        lengths: lengths.to_vec(),
        dtype,
        seed,
    };
    vec![
        // Multi-head, one token, a full cache (length = capacity).
        case(8, 8, 1, 128, 1000, &[1000], 1),
        // GQA 4:1, 4 tokens (16 rows per block), a length-1 sequence (3 of its tokens see nothing).
        case(8, 2, 4, 64, 777, &[777, 1], 2),
        // GQA 4:1, one token, an empty sequence and lengths that are multiples of nothing.
        case(32, 8, 1, 128, 530, &[530, 0, 3, 333], 3),
        // 32 rows per block (two mma tiles): GQA 8:1 × 4 tokens.
        case(16, 2, 4, 128, 200, &[200, 37], 4),
        case(32, 8, 4, 64, 300, &[2, 299, 0], 5),
        // 16 new tokens, one of the sequences shorter than that.
        case(2, 2, 16, 64, 100, &[100, 10], 6),
        // 100 keys: 64 splits is more splits than key tiles (and than keys per split).
        case(8, 2, 1, 128, 100, &[100], 7),
        // A long cache: many tiles per split.
        case(32, 8, 1, 128, 4099, &[4099, 2500], 8),
        // More sequences than one launch takes (their lengths travel in the parameter struct,
        // 256 at a time): the batch is launched in chunks.
        case(4, 2, 1, 64, 70, &(0..300).map(|b| (b * 7) % 71).collect::<Vec<_>>(), 9),
        // More than 32 rows per kv head, in row blocks of 32: GQA 8 × 16 speculative tokens
        // (128 rows, 4 blocks), with a sequence shorter than its new tokens and an empty one.
        case(16, 2, 16, 128, 300, &[300, 9, 0], 10),
        // 33 rows: the second block holds one row, a token other than the first (its mask limit
        // is not the block's smallest).
        case(6, 2, 11, 64, 200, &[200, 70], 11),
        // Multi-query attention, 32 heads × 8 tokens = 256 rows (8 blocks) on one kv head.
        case(32, 1, 8, 64, 150, &[150, 129], 12),
        // d = 256: one 16-row tile per block. GQA 4 × 4 tokens (16 rows, one block), a sequence
        // shorter than its new tokens; multi-head with one token; GQA 8 × 4 (32 rows, two
        // blocks of 16 where d ≤ 128 takes one of 32).
        case(8, 2, 4, 256, 700, &[700, 3], 13),
        case(4, 4, 1, 256, 1500, &[1500, 0], 14),
        case(16, 2, 4, 256, 300, &[300, 77], 15),
        // Head dims the kernels pad: to 16 columns in the products and 64 in shared memory
        // (d = 8, 40, 200), to 64 only (96, Phi-3's, and 192), past 128 (one 16-row tile per
        // block: 24 rows in two blocks at d = 192).
        case(4, 4, 1, 8, 130, &[130], 16),
        case(8, 2, 4, 40, 300, &[300, 65], 17),
        case(16, 2, 4, 96, 500, &[500, 1], 18),
        case(8, 2, 4, 136, 260, &[260, 17], 19),
        case(8, 1, 3, 192, 400, &[400, 0], 20),
        case(4, 2, 2, 200, 333, &[333, 64], 21),
    ]
    .into_iter()
    .filter(|c| head_dims().contains(&c.d))
    .collect()
}

/// A tensor of all-ones bytes (NaN in every float type), so that an element no kernel writes
/// cannot pass a check.
pub fn nan_tensor(gpu: &Gpu, shape: &[usize], dtype: DType) -> Tensor {
    let mut t = gpu.zeros(shape, dtype).expect("zeros");
    gpu.fill_bytes(&mut t, 0xff).expect("fill");
    t
}

/// Raw bytes of `O` and `lse`.
pub fn bytes(out: &Output) -> (Vec<u8>, Vec<u8>) {
    (out.o.to_bytes().expect("copy"), out.lse.to_bytes().expect("copy"))
}
