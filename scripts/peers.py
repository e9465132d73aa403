#!/usr/bin/env python3
"""Time the ladder's peers on the shapes of `ladder bench`, into OUT/peers.csv.

Peers: PyTorch SDPA's flash, cuDNN and memory-efficient backends, and the Triton tutorial's
fused-attention kernel (vendored in scripts/triton_fused_attention.py), forward and backward, and
its FP8 forward (`triton-fp8`: e5m2 inputs, V transposed, converted untimed; the CSV's dtype is
the fp16 the inputs came in, as for `ladder bench`'s fa3-fp8 rows), and cuDNN's FP8 forward
(`cudnn-fp8`, below; its rows likewise carry the dtype the inputs came in).
Timing as in `ladder bench`: one untimed call (compiles / autotunes), warm-up calls, then CUDA
events around each sample (several calls back to back when one is under a millisecond), median
per call; inputs rotate among several sets when they fit in L2. The backward pass is timed alone
(autograd.grad of a forward output computed beforehand).

Writes OUT/peers.csv in the schema of bench.csv (`ladder bench --charts-only --out OUT` then draws
both), and fills OUT/meta.json's `torch` field (and card, cuda, date if `ladder bench` has not).
A backend that refuses a shape is reported as skipped, with its reason.

`--direction decode` times the SDPA backends and FlashInfer (not the Triton tutorial) on the
decoding shapes of `ladder bench --direction decode`: one new token, q [B, Hq, 1, d] against k, v
[B, Hkv, L, d] (enable_gqa when Hq != Hkv), d = 128; rows with direction `decode` and tbps = bytes
of K and V read / time. --n, --batch and --heads-kv replace the shapes by their grid, as in
`ladder bench`.
`ladder bench` also times 4 new tokens and paged caches on the reference shapes; the peers time
one new token against a contiguous cache (--new-tokens and --page-size are accepted and ignored,
so that scripts/gpu-bench.sh can pass its flags to both).

`flashinfer` (decode only; the flashinfer-python package, imported only when asked for) is
FlashInfer's BatchDecodeWithPagedKVCacheWrapper with its defaults (the CUDA-core decode kernel,
use_tensor_cores=False, programmatic dependent launch as on every sm_90+ card, as our decode
kernel launches), planned once per shape outside the timed region. It reads the same
contiguous cache through a page table: pages of FLASHINFER_PAGE_SIZE tokens, HND, laid over
[B, Hkv, L, d] as a strided view (no copy; the page size sets how finely FlashInfer can split a
sequence across thread blocks), so it reads the same bytes as the SDPA rows; its first call is
checked against SDPA. Its kernels are compiled at first use with the machine's nvcc (ninja; about
a minute per dtype, cached under FLASHINFER_WORKSPACE_BASE, /tmp/flashinfer by default).

`cudnn-fp8` (forward only; the nvidia-cudnn-frontend package, imported only when asked for) is
cuDNN's FP8 attention forward through the frontend's graph API (`pygraph.sdpa_fp8`), run by the
cuDNN library that torch bundles: one graph per case (shape, mask; the causal mask top-left, which
is the ladder's bottom-right one since n_q == n_kv), built outside the timed region. Q, K, V are
quantised untimed to e4m3 with one scale per tensor (scale = 448 / amax, descale = 1 / scale, as
float32 one-element GPU tensors), softmax probabilities with scale 448 (the frontend's bound for
E4M3 without dropout). O comes out in e4m3 (scale_o = 1 / descale_v, since |O| <= amax |V|) on
Hopper: cuDNN takes an fp16/bf16 O only on Blackwell with cuDNN >= 9.13 (the frontend's own rule),
where O comes out in the input dtype. Its first call is checked against SDPA (relative L2 at most
CUDNN_FP8_MAX_REL). `--fp8-outlier-error` also runs the FA3 paper's FP8 accuracy test (section 4.3)
on cudnn-fp8 and triton-fp8 and writes OUT/fp8-error.csv (see fp8_outlier_error).

`flex` (forward and backward) is PyTorch's FlexAttention (torch.nn.attention.flex_attention under
torch.compile, its Triton kernels generated and autotuned at the first call, untimed) with a
`mask_mod` for the mask: none for a full case, `kv_idx <= q_idx` for causal, and for a sliding window
(--window LEFT,RIGHT, flash-attention's window_size, bottom-right aligned as the ladder's masks)
`q_idx - LEFT <= kv_idx <= q_idx + RIGHT`; its BlockMask is made once per shape and mask
(create_block_mask), outside the timed region, so that it skips the tiles the mask empties. Its
first call is checked against SDPA on one (batch, head) slice (with a dense mask for a window).
A windowed case counts TFLOP/s on the query-key pairs the window attends, as `ladder bench` does;
only `flex` takes a window. `--score-mod` (softcap:CAP, alibi, softcap:CAP+alibi, relative-bias,
the ladder's modifiers: crates/compare/src/modifiers.rs) gives `flex` the same function as its
`score_mod`, counting the FLOPs of the unmodified case; its first call is then checked against the
same modifier applied to the scores of one (batch, head) slice by hand. `--mask-mod` (documents:N,
prefix-lm:P, as `ladder run --mask-mod`: N near-equal documents, key j in document j·N // n, or a
prefix of P keys seen by every query; ragged:N, N documents alternately 100 tokens longer and
shorter than n / N, the last taking the rest, as mask_mod_speed's uneven documents) adds the same mask to `flex`'s `mask_mod` (and its
BlockMask, made once per shape outside the timed region, as FlexAttention advises), counting
TFLOP/s on the pairs the mask attends; its first call is checked against SDPA with the dense mask.

The frontend is not on the GPU machine's index: its wheel (cp312, manylinux x86_64, ~12 MB) is
downloaded here into .whl/ (kept out of git by .git/info/exclude), carried to the machine with the
working tree (carry .whl), and installed there into a scratch folder, without its dependencies
(nvidia-cutlass-dsl and apache-tvm-ffi feed only the frontend's own CuTe DSL engines, which the
frontend declines when they are absent; none serves per-tensor FP8 attention on sm_90, which the
cuDNN library's engines serve). It also imports cuda.bindings (cuda-bindings, in the GPU image):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl nvidia-cudnn-frontend
    # on the GPU machine (carry .whl):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/nvidia_cudnn_frontend-*.whl && export PYTHONPATH=/tmp/site
    python3 scripts/peers.py --out /tmp/r --direction fwd --impl cudnn-fp8,triton-fp8

The frontend loads the libcudnn it finds (LD_LIBRARY_PATH, then site-packages' nvidia/cudnn/lib,
where torch's nvidia-cudnn-cu13 lives); a version other than torch's is reported on stderr.

Run on the GPU machine from the repo root (torch and triton installed, no network needed):

    python3 scripts/peers.py --out bench-results              # the full sweep
    python3 scripts/peers.py --out /tmp/r --quick --impl sdpa-flash,triton
    python3 scripts/peers.py --out bench-results --direction decode  # decoding, TB/s
    PYTHONPATH=/tmp/site python3 scripts/peers.py --out /tmp/r --quick --impl cudnn-fp8 --fp8-outlier-error
"""
import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import warnings

# The columns of ladder_compare::results::COLUMNS (crates/compare/src/results.rs), which reads this
# file by column name: keep the two in step.
HEADER = ["impl", "direction", "dtype", "causal", "batch", "heads_q", "heads_kv",
          "n_q", "n_kv", "d", "ms", "tflops", "tbps", "page_size",  # page_size: empty (no paged peers)
          "layout",  # empty for [b, h, s, d]; bshd: [b, s, h, d] in memory, a transposed view
          "window",  # empty for none; LEFT:RIGHT (-1 open) for a sliding window
          "score_mod",  # empty for none; softcap:CAP, alibi, softcap:CAP+alibi or relative-bias
          "mask_mod"]  # empty for none; documents:N or prefix-lm:P
IMPLS = ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "triton", "triton-fp8", "cudnn-fp8", "flex",
         "flashinfer"]
# Peers that take a sliding window (--window): FlexAttention's mask_mod. SDPA's backends have no
# window but a dense boolean mask, which is another algorithm (and n² bytes): skipped.
WINDOW_IMPLS = ["flex"]
# Peers that take a score modifier (--score-mod): FlexAttention's score_mod.
SCORE_MOD_IMPLS = ["flex"]
# Peers that take a mask modifier (--mask-mod): FlexAttention's mask_mod, with its BlockMask.
MASK_MOD_IMPLS = ["flex"]
BIAS_RADIUS = 16  # the relative bias's table: distances clamped to +-16 (as modifiers.rs)
L2_BYTES = 50 << 20  # H100/H200 L2: inputs smaller than this rotate among several sets
SAMPLE_MS = 1.0      # a timed sample spans at least this long
# The decoding shapes of `ladder bench --direction decode` (crates/compare/src/bench/plan.rs):
# keep the two in step.
DECODE_HEADS_Q = 32
DECODE_MAX_KV_BYTES = 40_000_000_000  # shapes whose K and V together exceed this are left out
DECODE_ISSUE_SHAPES = [(1, 32, 32, 8 << 10), (1, 32, 32, 128 << 10), (16, 32, 32, 32 << 10),
                       (1, 32, 8, 8 << 10), (16, 32, 8, 32 << 10)]  # (batch, heads_q, heads_kv, L)
DECODE_BATCHES = [1, 4, 16, 64]
DECODE_LENGTHS = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 128 << 10]
DECODE_HEADS_KV = [32, 8]
DECODE_IMPLS = ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flashinfer"]  # no Triton tutorial
FLASHINFER_PAGE_SIZE = 16  # tokens per page of FlashInfer's page table over the contiguous cache
FLASHINFER_WORKSPACE_BYTES = 128 << 20  # its float workspace (split-KV partial results): FlashInfer's advice
FLASHINFER_BASE = "/tmp/flashinfer"  # FLASHINFER_WORKSPACE_BASE unless set (JIT builds: .cache/flashinfer)
# The first FlashInfer call is checked against SDPA on the same inputs: max abs error and
# ‖out − ref‖ / ‖ref‖ (both fp16/bf16 with float32 accumulation; they differ by roundings, ~1e-3).
FLASHINFER_MAX_ABS = 2e-2
FLASHINFER_MAX_REL = 2e-2
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# cudnn-fp8's first call against SDPA (fp16/bf16): ‖out − ref‖ / ‖ref‖ at most this. e4m3 keeps 3
# mantissa bits (roundings of up to 6 %), on Q, K, V, P and on Hopper O: ~5 % is expected, a wrong
# layout or scale gives ~100 %.
CUDNN_FP8_MAX_REL = 0.25
CUDNN_HINT = "install the nvidia-cudnn-frontend wheel: see scripts/peers.py header"
# flex's and the Triton tutorial's first call against SDPA on one (batch, head) slice, a dense mask
# for a window: max abs error (both fp16/bf16 with float32 accumulation: roundings, ~1e-3; a wrong
# mask gives ~1).
FIRST_CALL_MAX_ABS = 2e-2
# The Triton tutorial's autotuned forward configuration per (d, n, causal, warp_specialize),
# recorded after its first call: written to triton-configs.csv beside peers.csv.
TRITON_CONFIGS = []
# --fp8-outlier-error: the FA3 paper's FP8 accuracy test (section 4.3), one fixed shape.
OUTLIER_SHAPE = (1, 16, 4096, 128)  # batch, heads, n, d; not causal
OUTLIER_P, OUTLIER_STD, OUTLIER_SEED = 0.001, 10.0, 0


class Skip(Exception):
    """This implementation does not run this case (the reason is the message)."""


def parse_window(text):
    """`none` -> None; `LEFT,RIGHT` -> (left, right), each a count of keys or None (-1: open)."""
    if text.strip() == "none":
        return None
    parts = text.split(",")
    try:
        sides = [int(x) for x in parts]
    except ValueError:
        sides = []
    if len(sides) != 2 or min(sides) < -1:
        raise argparse.ArgumentTypeError(f"a window is LEFT,RIGHT (e.g. 4095,0 or 128,-1), got {text!r}")
    window = tuple(None if x == -1 else x for x in sides)
    return None if window == (None, None) else window


def window_field(window):
    """The CSV's window field: empty for none, LEFT:RIGHT (-1 open) otherwise."""
    if window is None:
        return ""
    return ":".join("-1" if x is None else str(x) for x in window)


def band(causal, window):
    """(left, right) of the visible band around the diagonal (None: open) after the causal mask."""
    left, right = window or (None, None)
    return left, (0 if causal else right)


def parse_score_mod(text):
    """`none`, softcap:CAP, alibi, softcap:CAP+alibi, relative-bias or sinks (as `ladder bench
    --score-mod`)."""
    text = text.strip()
    if text == "none":
        return None
    if text in ("alibi", "relative-bias", "sinks"):
        return text
    if text.startswith("softcap:"):
        cap = text[len("softcap:"):].removesuffix("+alibi")
        try:
            ok = float(cap) > 0 and math.isfinite(float(cap))
        except ValueError:
            ok = False
        if ok:
            return text
    raise argparse.ArgumentTypeError(
        f"a modifier is softcap:CAP, alibi, softcap:CAP+alibi, relative-bias or sinks, got {text!r}")


def alibi_slopes(heads):
    """The ALiBi paper's slopes (ScoreMod::alibi_slopes in the reference crate)."""
    def power_of_two(n):
        return [2 ** (-8 * k / n) for k in range(1, n + 1)]
    if heads & (heads - 1) == 0:
        return power_of_two(heads)
    below = 1 << (heads.bit_length() - 1)
    return power_of_two(below) + power_of_two(2 * below)[0::2][:heads - below]


def score_mod_fn(torch, spec, heads, shift):
    """The ladder's modifier `spec` as a function of (score, b, h, q_idx, kv_idx) on tensors: a
    FlexAttention score_mod, and (on whole tensors) the check's reference. (Sinks are no
    score_mod: make_flex_step applies them to the output.)"""
    if spec is None or spec == "sinks":
        return None
    slopes = torch.tensor(alibi_slopes(heads), device="cuda", dtype=torch.float32)
    width = 2 * BIAS_RADIUS + 1
    table = (torch.rand(heads * width, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
             - 0.5)  # values do not matter for timing; the check uses the same table
    cap = float(spec[len("softcap:"):].removesuffix("+alibi")) if spec.startswith("softcap:") else None

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if spec == "alibi" or spec.endswith("+alibi"):
            score = score - slopes[h] * (kv_idx - q_idx - shift).abs()
        if spec == "relative-bias":
            r = torch.clamp(kv_idx - q_idx - shift, -BIAS_RADIUS, BIAS_RADIUS) + BIAS_RADIUS
            score = score + table[h * width + r]
        return score
    return score_mod


def parse_mask_mod(text):
    """documents:N (N near-equal documents: key j in document j·N // n, as the ladder's
    MaskSpec), ragged:N (uneven documents, ragged_lengths), prefix-lm:P, or none."""
    if text == "none":
        return None
    name, _, value = text.partition(":")
    if (name not in ("documents", "ragged", "prefix-lm") or not value.isdigit()
            or (name in ("documents", "ragged") and int(value) < 1)):
        raise argparse.ArgumentTypeError(
            f"a mask modifier is documents:N, ragged:N (N >= 1) or prefix-lm:P, got {text!r}")
    return f"{name}:{int(value)}"


def ragged_lengths(docs, n):
    """Document lengths alternately 100 tokens longer and shorter than n // docs, the last taking
    what is left (mask_mod_speed's Ragged): boundaries inside the kernels' tiles."""
    lens = [n // docs + 100 if i % 2 == 0 else n // docs - 100 for i in range(docs)]
    lens[-1] = n - sum(lens[:-1])
    if min(lens) < 1:
        raise SystemExit(f"ragged:{docs} needs more than {100 * docs} tokens, got {n}")
    return lens


def mask_mod_pairs(spec, n, causal):
    """The pairs a mask modifier attends at n_q = n_kv = n (results.rs's mask_pairs); prefix-LM is
    a whole mask, meant without --causal: with it, the causal pairs."""
    name, _, value = spec.partition(":")
    value = int(value)
    if name in ("documents", "ragged"):
        if name == "documents":
            start = [-(-i * n // value) for i in range(value + 1)]
            lens = [b - a for a, b in zip(start, start[1:])]
        else:
            lens = ragged_lengths(value, n)
        return sum(x * (x + 1) // 2 if causal else x * x for x in lens)
    if causal:
        return n * (n + 1) // 2
    p = min(value, n)
    return p * p + sum(range(p + 1, n + 1))


def csv_list(convert, choices=None):
    def parse(text):
        items = [convert(x.strip()) for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {choices or 'values'}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", type=csv_list(str, IMPLS), default=IMPLS, help="peers to time [all]")
    p.add_argument("--direction", type=csv_list(str, ["fwd", "bwd", "decode"]), default=["fwd", "bwd"],
                   help="fwd, bwd, decode [fwd,bwd]")
    p.add_argument("--d", type=csv_list(int), help="head dims [64,128; 128 with --quick]")
    p.add_argument("--n", type=csv_list(int),
                   help="lengths [512..16384; 1024,4096 with --quick]; decode: KV cache lengths L")
    p.add_argument("--batch", type=csv_list(int), help="decode only: batch sizes [1,4,16,64]")
    p.add_argument("--heads-kv", type=csv_list(int), help="decode only: kv heads for 32 query heads [32,8]")
    p.add_argument("--layout", type=csv_list(str, ["bhsd", "bshd"]), default=["bhsd"],
                   help="prefill: memory layouts of q, k, v: bhsd, bshd ([b, s, h, d] handed over "
                        "as a transposed view, as `ladder bench --layout`) [bhsd]")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both",
                   help="masks [both; false with --quick]")
    p.add_argument("--window", action="append", type=parse_window,
                   help="a sliding window LEFT,RIGHT (-1 open; 4095,0 is Mistral's; write --window=-1,0 "
                        "when LEFT is open) or none; once per window [none]; windowed cases run on "
                        "the peers that take one (flex)")
    p.add_argument("--score-mod", action="append", type=parse_score_mod,
                   help="a score modifier (softcap:CAP, alibi, softcap:CAP+alibi, relative-bias) or "
                        "none; once per modifier [none]; modified cases run on the peers that take "
                        "one (flex)")
    p.add_argument("--mask-mod", action="append", type=parse_mask_mod,
                   help="a mask modifier (documents:N, prefix-lm:P: as `ladder run --mask-mod`; ragged:N) or "
                        "none; once per modifier [none]; masked cases run on the peers that take "
                        "one (flex), their TFLOP/s counting the pairs the mask attends")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--repeats", type=int, help="timed samples per case [30; 5 with --quick]")
    p.add_argument("--warmup", type=int, help="warm-up calls per case [5; 2 with --quick]")
    p.add_argument("--out", default="bench-results", help="results folder [bench-results]")
    p.add_argument("--quick", action="store_true", help="a small subset for smoke runs")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / n [16384]")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / d [2048]")
    p.add_argument("--case-budget-s", type=float, default=3.0,
                   help="stop sampling a case after this many seconds of samples [3]")
    p.add_argument("--splits", type=int,
                   help="ignored: ladder bench's decode split count (accepted so gpu-bench.sh can pass it)")
    p.add_argument("--new-tokens", help="ignored: ladder bench's decode new tokens (the peers time one)")
    p.add_argument("--page-size", help="ignored: ladder bench's paged KV caches (the peers' are contiguous)")
    p.add_argument("--triton-warp-specialize", action="store_true",
                   help="run the Triton kernel with warp_specialize=True (default False: with triton "
                        "3.6 on sm_90 the tutorial kernel then fails to compile, in the "
                        "NVGPUWarpSpecialization pass; docs/results/history/h200-triton-ws)")
    p.add_argument("--fp8-outlier-error", action="store_true",
                   help="also run the FA3 paper's FP8 accuracy test (Q, K, V ~ N(0,1) + N(0,100)·"
                        "Bernoulli(0.001), b=1, h=16, n=4096, d=128, not causal) on cudnn-fp8 and "
                        "triton-fp8 among --impl: RMSE against a float64 reference, into OUT/fp8-error.csv")
    a = p.parse_args(argv)
    a.decode_d = a.d or [128]
    a.decode = decode_shapes(a) if "decode" in a.direction else []
    a.d = a.d or ([128] if a.quick else [64, 128])
    a.n = a.n or ([1024, 4096] if a.quick else [512, 1024, 2048, 4096, 8192, 16384])
    a.causals = {"true": [True], "false": [False]}.get(a.causal, [False] if a.quick else [False, True])
    a.windows = a.window or [None]
    a.score_mods = a.score_mod or [None]
    a.mask_mods = a.mask_mod or [None]
    a.repeats = max(1, a.repeats if a.repeats is not None else (5 if a.quick else 30))
    a.warmup = max(1, a.warmup if a.warmup is not None else (2 if a.quick else 5))
    for d in a.d:
        if d <= 0 or a.hidden % d:
            p.error(f"--d {d}: the hidden size {a.hidden} must be a multiple of d")
    if a.tokens <= 0 or min(a.n) <= 0:
        p.error("--tokens and --n must be positive")
    if min(a.batch or [1]) <= 0 or any(h <= 0 or DECODE_HEADS_Q % h for h in a.heads_kv or []):
        p.error(f"--batch must be positive and --heads-kv must divide {DECODE_HEADS_Q}")
    return a


def decode_shapes(a, elem_bytes=2):
    """The decoding shapes (batch, heads_q, heads_kv, L), as `ladder bench --direction decode`
    picks them: the five reference decode shapes and the batch × GQA × length sweep (the reference shapes only with
    --quick), or the grid of --batch, --heads-kv, --n when any is given; K and V together at most
    DECODE_MAX_KV_BYTES."""
    overridden = bool(a.n or a.batch or a.heads_kv)
    shapes = [] if overridden else list(DECODE_ISSUE_SHAPES)
    if not a.quick or overridden:
        for batch in a.batch or DECODE_BATCHES:
            for heads_kv in a.heads_kv or DECODE_HEADS_KV:
                for n in a.n or DECODE_LENGTHS:
                    shape = (batch, DECODE_HEADS_Q, heads_kv, n)
                    if shape not in shapes:
                        shapes.append(shape)
    d = max(a.decode_d)
    return [s for s in shapes if 2 * s[0] * s[2] * s[3] * d * elem_bytes <= DECODE_MAX_KV_BYTES]


def attended_pairs(n_q, n_kv, causal, window):
    """The query-key pairs visible under the mask, row by row (row i's diagonal is key
    i + n_kv - n_q; it sees the keys within (left, right) of it, inside 0..n_kv)."""
    left, right = band(causal, window)
    total = 0
    for i in range(n_q):
        diag = i + n_kv - n_q
        end = n_kv if right is None else min(n_kv, max(0, diag + right + 1))
        start = 0 if left is None else min(end, max(0, diag - left))
        total += end - start
    return total


def flops(direction, batch, heads_q, n_q, n_kv, d, causal, window=None, mask_mod=None):
    """The ladder's convention: forward 4·B·Hq·n_q·n_kv·d, halved for causal with n_q == n_kv
    (bottom-right causal with n_q != n_kv, any window, and a mask modifier count the visible
    pairs); backward 2.5× forward."""
    if mask_mod is not None and window is None and n_q == n_kv:
        pairs = mask_mod_pairs(mask_mod, n_q, causal)
    elif window is not None:
        pairs = attended_pairs(n_q, n_kv, causal, window)
    elif not causal:
        pairs = n_q * n_kv
    elif n_q == n_kv:
        pairs = n_q * n_kv / 2
    else:
        pairs = sum(min(n_kv, max(0, i + n_kv - n_q + 1)) for i in range(n_q))
    forward = 4.0 * batch * heads_q * pairs * d
    return 2.5 * forward if direction == "bwd" else forward


def dims(args, d, n):
    """(batch, heads) of the sweep at head dim d and length n."""
    return max(1, args.tokens // n), args.hidden // d


def sets_for(bytes_per_set):
    """How many input sets to rotate among so that they do not all sit in L2."""
    if bytes_per_set >= L2_BYTES:
        return 1
    return min(32, max(2, -(-2 * L2_BYTES // max(1, bytes_per_set))))


def csv_row(impl, direction, dtype, causal, batch, heads, n, d, ms, layout="bhsd", window=None,
            score_mod=None, mask_mod=None):
    tflops = flops(direction, batch, heads, n, n, d, causal, window, mask_mod) / (ms * 1e-3) / 1e12
    return {"impl": impl, "direction": direction, "dtype": dtype, "causal": str(causal).lower(),
            "batch": batch, "heads_q": heads, "heads_kv": heads, "n_q": n, "n_kv": n, "d": d,
            "ms": f"{ms:.6f}", "tflops": f"{tflops:.3f}", "tbps": "",
            "layout": "" if layout == "bhsd" else layout, "window": window_field(window),
            "score_mod": score_mod or "", "mask_mod": mask_mod or ""}


def decode_row(impl, dtype, batch, heads_q, heads_kv, n_q, n_kv, d, ms, elem_bytes=2):
    """A decode row: tbps = bytes of K and V (2 · B · Hkv · L · d · element size) / time, tflops by
    the forward convention (4 · B · Hq · n_q · L · d)."""
    tflops = flops("fwd", batch, heads_q, n_q, n_kv, d, False) / (ms * 1e-3) / 1e12
    tbps = 2 * batch * heads_kv * n_kv * d * elem_bytes / (ms * 1e-3) / 1e12
    return {"impl": impl, "direction": "decode", "dtype": dtype, "causal": "false",
            "batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "n_q": n_q, "n_kv": n_kv,
            "d": d, "ms": f"{ms:.6f}", "tflops": f"{tflops:.3f}", "tbps": f"{tbps:.4f}"}


def write_csv(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=HEADER, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def merge_meta(path, fields, if_empty):
    """Set `fields` in the JSON object at `path`, and `if_empty` only where no value is there
    (card, driver, date written by `ladder bench` stay as they are)."""
    meta = {}
    if os.path.exists(path):
        try:
            with open(path) as fh:
                meta = json.load(fh)
        except (OSError, ValueError):
            meta = {}
    meta.update(fields)
    for k, v in if_empty.items():
        if not meta.get(k):
            meta[k] = v
    for k in ["card", "driver", "cuda", "date", "torch", "note"]:
        meta.setdefault(k, "")
    with open(path, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")


def render(results):
    """One line per case: time and throughput (and TB/s for decode), or why it was skipped."""
    lines = [f"{'impl':<15} {'dir':<6} {'dtype':<5} {'d':>4} {'n':>12} {'mask':<8} {'ms':>10} "
             f"{'TFLOP/s':>9} {'TB/s':>7}"]
    for (impl, direction, dtype, d, n, mask), outcome in results:
        head = f"{impl:<15} {direction:<6} {dtype:<5} {d:>4} {n:>12} {mask:<8}"
        if isinstance(outcome, str):
            lines.append(f"{head} skipped: {outcome}")
        else:
            ms, tflops, tbps = (*outcome, None)[:3]
            tb = "-" if tbps is None else f"{tbps:.2f}"
            lines.append(f"{head} {ms:>10.4f} {tflops:>9.1f} {tb:>7}")
    return "\n".join(lines)


# ---- timing (needs torch and a GPU) ------------------------------------------------------------

def measure(torch, call_on, nsets, warmup, repeats, budget_ms):
    """Median milliseconds per call of `call_on(i)` (i = input set), CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    counter = [0]

    def call():
        out = call_on(counter[0] % nsets)
        counter[0] += 1
        return out

    call()  # compiles / autotunes: not timed
    torch.cuda.synchronize()
    single = math.inf
    for _ in range(warmup):
        start.record()
        keep = call()
        end.record()
        end.synchronize()
        single = min(single, start.elapsed_time(end))
    del keep
    calls = min(64, max(1, math.ceil(SAMPLE_MS / max(single, 1e-4))))
    samples, total = [], 0.0
    for _ in range(repeats):
        keep = []
        start.record()
        for _ in range(calls):
            keep.append(call())  # outputs freed after the end event, outside the timed region
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        del keep
        samples.append(ms / calls)
        total += ms
        if total > budget_ms:
            break
    return statistics.median(samples)


def step_of(torch, attend, sets, direction):
    """The timed call of `attend(q, k, v)` on input set i: the forward without autograd, or the
    backward alone (autograd.grad of a forward output computed here, beforehand)."""
    if direction == "fwd":
        def forward(i):
            q, k, v, _ = sets[i]
            with torch.no_grad():
                return attend(q, k, v)
        return forward
    graphs = []
    for q, k, v, d_o in sets:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        graphs.append((attend(*leaves), leaves, d_o))

    def backward(i):
        o, leaves, d_o = graphs[i]
        return torch.autograd.grad(o, leaves, d_o, retain_graph=True)
    return backward


def mask_label(causal, window, score_mod=None, mask_mod=None):
    """full, causal, or w{LEFT}:{RIGHT} after the causal mask, then ·MASK for a mask modifier and
    +MOD for a score modifier (as `ladder bench` labels it)."""
    mask = ("causal" if causal else "full") if window is None else "w" + window_field(band(causal, window))
    mask = mask if mask_mod is None else f"{mask}·{mask_mod}"
    return mask if score_mod is None else f"{mask}+{score_mod}"


def check_first_call(torch, attend, sets, reference, who):
    """The first call of `attend` on input set 0 (it compiles or autotunes on the real shape,
    untimed), its first (batch, head) slice checked against `reference` (SDPA) on that slice: max
    abs error at most FIRST_CALL_MAX_ABS, or a RuntimeError naming `who`."""
    with torch.no_grad():
        got = attend(*sets[0][:3])[:1, :1].float()
        ref = reference(*(t[:1, :1] for t in sets[0][:3])).float()
        err = (got - ref).abs().amax().item()
    if not err <= FIRST_CALL_MAX_ABS:  # NaN fails too
        raise RuntimeError(f"{who}'s output differs from SDPA's: max abs {err:.3g} "
                           f"(tolerance {FIRST_CALL_MAX_ABS})")


_flex = []  # [flex_attention compiled, create_block_mask] once imported


def mask_mod_rows(torch, spec, n_q, n_kv):
    """A mask modifier as a function of (q_idx, kv_idx) tensors (bottom-right aligned, as the
    ladder's), for FlexAttention's mask_mod and for the dense reference mask."""
    if spec is None:
        return None
    name, _, value = spec.partition(":")
    value, shift = int(value), n_kv - n_q
    if name in ("documents", "ragged"):
        if name == "documents":
            ids = torch.arange(n_kv, device="cuda") * value // n_kv
        else:
            lens = torch.tensor(ragged_lengths(value, n_kv), device="cuda")
            ids = torch.repeat_interleave(torch.arange(value, device="cuda"), lens)
        return lambda q_idx, kv_idx: ids[(q_idx + shift).clamp(min=0)] == ids[kv_idx]
    return lambda q_idx, kv_idx: (kv_idx < value) | (kv_idx <= q_idx + shift)


def make_flex_step(torch, sets, causal, window, direction, score_mod_spec=None, mask_mod_spec=None):
    """FlexAttention on the input sets: its BlockMask made here (untimed), its first call checked
    against SDPA on the first (batch, head) slice of set 0 (with a score modifier, against the
    modifier applied by hand to that slice's scores)."""
    if not _flex:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # Each shape, mask and score_mod compiles a kernel of its own: past dynamo's recompile
        # limit (8) the later cases would run eagerly and be timed so (seen: 5.9 TFLOP/s).
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 1024)
        _flex.extend([torch.compile(flex_attention, dynamic=False), create_block_mask])
    flex, create_block_mask = _flex
    q0, k0 = sets[0][0], sets[0][1]
    n_q, n_kv = q0.shape[2], k0.shape[2]
    shift = n_kv - n_q
    left, right = band(causal, window)
    block_mask = None
    extra = mask_mod_rows(torch, mask_mod_spec, n_q, n_kv)
    if left is not None or right is not None or extra is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            diag = q_idx + shift
            keep = kv_idx >= 0
            if right is not None:
                keep = keep & (kv_idx <= diag + right)
            if left is not None:
                keep = keep & (kv_idx >= diag - left)
            if extra is not None:
                keep = keep & extra(q_idx, kv_idx)
            return keep
        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n_q, KV_LEN=n_kv, device="cuda")

    score_mod = score_mod_fn(torch, score_mod_spec, q0.shape[1], shift)
    # Attention sinks (gpt-oss) the way a FlexAttention user adds them: a sink has no value, so
    # O_sink = O · exp(lse) / (exp(lse) + exp(σ)) = O · sigmoid(lse − σ), from the lse Flex returns.
    sinks = None
    if score_mod_spec == "sinks":
        sinks = (torch.rand(q0.shape[1], device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1)) * 4 - 1)

    def attend(q, k, v):
        if sinks is None:
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
        o, lse = flex(q, k, v, block_mask=block_mask, return_lse=True)
        return o * torch.sigmoid(lse - sinks[:, None]).unsqueeze(-1).to(o.dtype)

    def reference(q, k, v):  # SDPA with the same band as a dense mask (by hand with a modifier)
        i = torch.arange(n_q, device="cuda")[:, None] + shift
        j = torch.arange(n_kv, device="cuda")[None, :]
        dense = torch.ones(n_q, n_kv, dtype=torch.bool, device="cuda")
        if right is not None:
            dense &= j <= i + right
        if left is not None:
            dense &= j >= i - left
        if extra is not None:
            dense &= extra(i - shift, j)
        if score_mod is None and sinks is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if sinks is not None:  # one more logit per row, whose value is zero
            s = s.masked_fill(~dense, float("-inf"))
            sink = sinks[: s.shape[-3], None, None].expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
            return (p @ v.float()).to(q.dtype)
        zero = torch.zeros((), dtype=torch.int64, device="cuda")
        s = score_mod(s, zero, zero, i - shift, j).masked_fill(~dense, float("-inf"))
        return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)
    check_first_call(torch, attend, sets, reference, "FlexAttention")
    return step_of(torch, attend, sets, direction)


def make_step(torch, impl, sets, causal, direction, d, args, window=None, score_mod=None,
              mask_mod=None):
    """A function of the input set index that runs one call of `impl`."""
    F = torch.nn.functional
    if mask_mod is not None and impl not in MASK_MOD_IMPLS:
        raise Skip(f"{impl} takes no mask modifier (only {', '.join(MASK_MOD_IMPLS)} here)")
    if window is not None and impl not in WINDOW_IMPLS:
        raise Skip(f"{impl} takes no sliding window (only {', '.join(WINDOW_IMPLS)} here)")
    if score_mod is not None and impl not in SCORE_MOD_IMPLS:
        raise Skip(f"{impl} takes no score modifier (only {', '.join(SCORE_MOD_IMPLS)} here)")
    if impl == "flex":
        return make_flex_step(torch, sets, causal, window, direction, score_mod, mask_mod)
    if impl == "flashinfer":
        raise Skip("FlashInfer is timed in decode only (--direction decode)")
    if impl == "cudnn-fp8":
        if direction != "fwd":
            raise Skip("cuDNN's FP8 attention is timed forward only")
        return CudnnFp8(torch, sets, causal, args)
    # The sweep's shapes are square (n_q == n_kv), where PyTorch's top-left `is_causal=True` and
    # the ladder's bottom-right causal mask (docs/conventions.md) are the same mask.
    if impl in ("triton", "triton-fp8"):
        if args.dtype != "fp16":
            raise Skip("the tutorial kernel is fp16 only")
        if direction == "bwd" and (impl == "triton-fp8" or not causal):
            raise Skip("the tutorial's backward pass is fp16 and causal only")
        try:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import triton_fused_attention as tfa
        except Exception as e:  # noqa: BLE001 - any import failure means no Triton peer
            raise Skip(f"triton not importable: {type(e).__name__}: {e}".splitlines()[0])
        ws, scale = args.triton_warp_specialize, 1.0 / math.sqrt(d)

        def attend(q, k, v):
            return tfa.attention(q, k, v, causal, scale, ws)
        if impl == "triton":  # the first call autotunes on the real shape; check it, record its pick
            check_first_call(torch, attend, sets,
                             lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                             "the Triton tutorial")
            best = getattr(tfa._attn_fwd, "best_config", None)
            config = (d, sets[0][0].shape[2], causal, ws, str(best).replace(",", ";"))
            if config not in TRITON_CONFIGS:  # the backward's case runs the same forward
                TRITON_CONFIGS.append(config)
    else:
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    if impl == "triton-fp8":
        # The tutorial's FP8 path, as its own benchmark calls it: e5m2 inputs (one scale: none),
        # V stored transposed; converted once, untimed, as `ladder bench` quantises fa3-fp8's.
        def fp8(q, k, v, d_o):
            vt = v.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
            return tuple(t.to(torch.float8_e5m2) for t in (q, k, vt)) + (d_o,)
        sets = [fp8(*s) for s in sets]

    return step_of(torch, attend, sets, direction)


def make_decode_step(torch, sets, grouped):
    """One decoding call of SDPA on input set i: q [B, Hq, 1, d] against the cache k, v."""
    F = torch.nn.functional

    def decode(i):
        q, k, v = sets[i]
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=grouped)
    return decode


_flashinfer = []  # [module] once imported, [Skip] once it failed


def import_flashinfer():
    """The flashinfer module, imported on first use; raises Skip (with why) where it is absent.

    Sets FLASHINFER_WORKSPACE_BASE (where its JIT builds and caches kernels) to FLASHINFER_BASE
    unless set, and puts the interpreter's bin folder on PATH when `ninja` is not on it (pip's
    ninja in a virtual environment that was not activated): FlashInfer runs `ninja` and `nvcc`."""
    if not _flashinfer:
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", FLASHINFER_BASE)
        bindir = os.path.dirname(sys.executable)
        if shutil.which("ninja") is None and shutil.which("ninja", path=bindir):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        try:
            import flashinfer
            _flashinfer.append(flashinfer)
        except Exception as e:  # noqa: BLE001 - any import failure means no FlashInfer peer
            _flashinfer.append(Skip(f"flashinfer not importable: {type(e).__name__}: {e}".splitlines()[0]))
    if isinstance(_flashinfer[0], Skip):
        raise _flashinfer[0]
    return _flashinfer[0]


def flashinfer_version():
    """flashinfer's version, or why it cannot be imported."""
    try:
        return import_flashinfer().__version__
    except Skip as e:
        return str(e)


def flashinfer_pages(torch, cache, page):
    """FlashInfer's paged view of a contiguous cache [B, Hkv, L, d], without copying it.

    Returns (pages, indptr, indices, last_page_len): `pages` is a strided view of `cache` as
    [num_pages, Hkv, page, d] (HND) with strides (page·d, L·d, d, 1), so that page number
    b·Hkv·(L/page) + j holds tokens j·page … j·page + page − 1 of sequence b, every head (head h
    is L·d further on, as in the cache); `indices` lists those pages in order for each sequence,
    `indptr` where each sequence's pages begin, `last_page_len` how full its last page is
    (all full). The view ends exactly at the cache's last element. L must be a multiple of `page`."""
    batch, heads_kv, n, d = cache.shape
    if n % page:
        raise Skip(f"L = {n} is not a multiple of FlashInfer's page size {page}")
    if not cache.is_contiguous():
        raise ValueError("flashinfer_pages needs a contiguous cache")
    per_seq = n // page
    num_pages = ((batch - 1) * heads_kv + 1) * per_seq
    pages = cache.as_strided((num_pages, heads_kv, page, d), (page * d, n * d, d, 1))
    kw = {"dtype": torch.int32, "device": cache.device}
    indices = (torch.arange(batch, **kw)[:, None] * (heads_kv * per_seq)
               + torch.arange(per_seq, **kw)[None, :]).reshape(-1)
    indptr = torch.arange(batch + 1, **kw) * per_seq
    last_page_len = torch.full((batch,), page, **kw)
    return pages, indptr, indices, last_page_len


# (dtype, d) -> None once its kernels are built or loaded, or the Skip of its failed build.
_flashinfer_built = {}


def make_flashinfer_decode_step(torch, sets, grouped, dtype_name):
    """One FlashInfer batch decode on input set i: q [B, Hq, 1, d] against the cache k, v, read
    through flashinfer_pages; planned here (outside the timed region, compiling the kernels on first
    use) and checked against SDPA on set 0 (raises when the output is wrong)."""
    fi = import_flashinfer()
    q0, k0, _ = sets[0]
    batch, heads_q, _, d = q0.shape
    heads_kv = k0.shape[1]
    page = FLASHINFER_PAGE_SIZE
    paged = []
    for q, k, v in sets:
        kp, indptr, indices, last = flashinfer_pages(torch, k, page)
        vp = flashinfer_pages(torch, v, page)[0]
        paged.append((q.view(batch, heads_q, d), (kp, vp)))
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q0.device)
    pdl = torch.cuda.get_device_capability(q0.device)[0] >= 9
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
    key = (dtype_name, d)
    if _flashinfer_built.get(key) is not None:
        raise _flashinfer_built[key]  # its build failed on an earlier shape: not tried again
    first = key not in _flashinfer_built
    if first:
        print(f"compiling FlashInfer decode kernels ({dtype_name}, d={d}; first use: a minute or so, "
              f"then cached under {os.environ.get('FLASHINFER_WORKSPACE_BASE', '~')}/.cache/flashinfer)…",
              file=sys.stderr, flush=True)
    started = datetime.datetime.now()
    try:
        # plan() builds (JIT, nvcc) or loads the kernels of this dtype and head dim on first use,
        # then splits the work among thread blocks for this shape.
        wrapper.plan(indptr, indices, last, heads_q, heads_kv, d, page,
                     q_data_type=q0.dtype, kv_data_type=k0.dtype)
    except Exception as e:
        text = str(e).strip()
        if first and any(w in text.lower() for w in ("ninja", "nvcc", "build", "compil")):
            head = text.splitlines()[0] if text else ""
            tail = [line.strip() for line in text.splitlines() if "error" in line.lower()][:2]
            why = [f"FlashInfer's JIT build failed: {type(e).__name__}: {head}"] + tail
            _flashinfer_built[key] = Skip("; ".join(why))
            print(text[-4000:], file=sys.stderr)  # the compiler's own words, for the log
            raise _flashinfer_built[key] from None
        raise
    if first:
        secs = (datetime.datetime.now() - started).total_seconds()
        print(f"FlashInfer decode kernels ready ({secs:.1f} s)", file=sys.stderr, flush=True)
        _flashinfer_built[key] = None

    def decode(i):
        q, kv = paged[i]
        # Programmatic dependent launch, FlashInfer's default from sm_90 on, said out loud: our
        # decode kernel is launched the same way (GpuConfig::programmatic_launch).
        return wrapper.run(q, kv, enable_pdl=pdl)

    # A wrong peer must not report figures: compare the first call with SDPA on the same inputs,
    # one sequence at a time (SDPA's fallback for GQA copies K and V per query head).
    with torch.no_grad():
        out = decode(0).float()
        max_abs, err2, ref2 = 0.0, 0.0, 0.0
        for b in range(batch):
            ref = torch.nn.functional.scaled_dot_product_attention(
                q0[b:b + 1], k0[b:b + 1], sets[0][2][b:b + 1], enable_gqa=grouped)
            ref = ref.reshape(heads_q, d).float()
            diff = out[b] - ref
            max_abs = max(max_abs, diff.abs().max().item())
            err2 += diff.square().sum().item()
            ref2 += ref.square().sum().item()
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else math.inf
    if not (max_abs <= FLASHINFER_MAX_ABS and rel <= FLASHINFER_MAX_REL):  # NaN fails too
        raise RuntimeError(f"FlashInfer's output differs from SDPA's: max abs {max_abs:.3g} "
                           f"(tolerance {FLASHINFER_MAX_ABS}), relative L2 {rel:.3g} "
                           f"(tolerance {FLASHINFER_MAX_REL})")
    del out, ref, diff
    return decode


_cudnn = []  # [module, handle] once imported, [Skip] once it failed


def import_cudnn(torch):
    """(cudnn, handle): the cuDNN frontend, imported on first use, and one cuDNN handle on torch's
    current stream; raises Skip (with why) where the frontend is absent."""
    if not _cudnn:
        torch.backends.cudnn.version()  # torch's libcudnn loaded first: the frontend then finds it
        try:
            import cudnn
            handle = cudnn.create_handle()
            cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
            _cudnn.extend([cudnn, handle])
        except Exception as e:  # noqa: BLE001 - any import failure means no cuDNN FP8 peer
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            _cudnn.append(Skip(f"cudnn (nvidia-cudnn-frontend) not importable: {why}; {CUDNN_HINT}"))
    if isinstance(_cudnn[0], Skip):
        raise _cudnn[0]
    return _cudnn[0], _cudnn[1]


def cudnn_version(torch):
    """The frontend's version and the cuDNN library it runs, or why it cannot be imported; warns on
    stderr when that library is not torch's."""
    try:
        cudnn = import_cudnn(torch)[0]
    except Skip as e:
        return str(e)
    if cudnn.backend_version() != torch.backends.cudnn.version():
        print(f"warning: the cuDNN frontend runs cuDNN {cudnn.backend_version()}, torch "
              f"{torch.backends.cudnn.version()}", file=sys.stderr)
    return f"{cudnn.__version__} (cuDNN {cudnn.backend_version_string()})"


def cudnn_fp8_half_out(torch, cudnn):
    """Whether cuDNN's FP8 forward can write O in fp16/bf16: on Blackwell (sm_100+) with cuDNN
    >= 9.13 only (the frontend refuses it elsewhere); otherwise O is e4m3."""
    return torch.cuda.get_device_capability()[0] >= 10 and cudnn.backend_version() >= 91300


def quantize_e4m3(torch, x):
    """x in float8_e4m3fn with one scale for the tensor (448 / amax; strides kept), and its descale
    (1 / scale, a float32 [1, 1, 1, 1] tensor on x's device)."""
    scale = E4M3_MAX / x.abs().amax().float().clamp_min(1e-30)
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    q.copy_((x.float() * scale).clamp_(-E4M3_MAX, E4M3_MAX))
    return q, (1.0 / scale).reshape(1, 1, 1, 1)


class CudnnFp8:
    """cuDNN's FP8 attention forward on the input sets `sets` ((q, k, v, _) each, [b, h, n, d]
    views): a call `step(i)` runs set i. The graph is built once here, the inputs quantised
    (untimed), and (`check`) the first call checked against SDPA (raises when it is wrong)."""

    SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")

    def __init__(self, torch, sets, causal, args, check=True):
        cudnn, handle = import_cudnn(torch)
        self.torch, self.cudnn, self.handle = torch, cudnn, handle
        q0 = sets[0][0]
        d = q0.shape[-1]
        if d % 16:
            raise Skip(f"cuDNN's FP8 attention takes head dims that are multiples of 16, not {d}")
        dt = cudnn.data_type
        self.half_out = cudnn_fp8_half_out(torch, cudnn)
        out_type = {"fp16": dt.HALF, "bf16": dt.BFLOAT16}[args.dtype] if self.half_out else dt.FP8_E4M3
        out_torch = q0.dtype if self.half_out else torch.float8_e4m3fn
        g = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT,
                          compute_data_type=dt.FLOAT, handle=handle)
        qkv = [g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dt.FP8_E4M3)
               for name, t in zip("qkv", sets[0][:3])]
        scalars = {name: g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
                   for name in self.SCALARS}
        o, _, amax_s, amax_o = g.sdpa_fp8(
            *qkv, **scalars, attn_scale=1.0 / math.sqrt(d), use_causal_mask=causal,
            generate_stats=False, name="sdpa_fp8")
        o.set_output(True).set_dim(list(q0.shape)).set_stride(list(q0.stride())).set_data_type(out_type)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.o = g, o
        self.workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=q0.device)

        def one(v):
            return torch.full((1, 1, 1, 1), v, dtype=torch.float32, device=q0.device)
        self.packs = []
        for q, k, v, _ in sets:
            (q8, dq), (k8, dk), (v8, dv) = (quantize_e4m3(torch, t) for t in (q, k, v))
            values = {"descale_q": dq, "descale_k": dk, "descale_v": dv,
                      "descale_s": one(1.0 / E4M3_MAX), "scale_s": one(E4M3_MAX),
                      # An e4m3 O scaled so that amax |V| (which bounds |O|) maps to 448.
                      "scale_o": one(1.0) if self.half_out else 1.0 / dv}
            pack = {t: x for t, x in zip(qkv, (q8, k8, v8))}
            pack.update({scalars[name]: x for name, x in values.items()})
            pack.update({o: torch.empty_like(q8, dtype=out_torch), amax_s: one(0.0), amax_o: one(0.0)})
            self.packs.append((pack, values["scale_o"]))

        # A wrong peer must not report figures: the first call against SDPA on the same inputs.
        if not check:
            return
        with torch.no_grad():
            ref = torch.nn.functional.scaled_dot_product_attention(*sets[0][:3], is_causal=causal).float()
            rel = ((self.output(0) - ref).norm() / ref.norm()).item()
        if not rel <= CUDNN_FP8_MAX_REL:  # NaN fails too
            raise RuntimeError(f"cuDNN FP8's output differs from SDPA's: relative L2 {rel:.3g} "
                               f"(tolerance {CUDNN_FP8_MAX_REL})")

    def __call__(self, i):
        pack = self.packs[i][0]
        self.graph.execute(pack, self.workspace, handle=self.handle)
        return pack[self.o]

    def output(self, i):
        """O of set i in float32 (descaled when e4m3), after running it."""
        o, scale_o = self(i), self.packs[i][1]
        return o.float() if self.half_out else o.float() / scale_o

    def calibrate(self, i):
        """Delayed scaling of an e4m3 O, as Transformer Engine does: run set i once, then scale_o =
        448 / amax |O| (with a margin for the e4m3 rounding of that amax)."""
        if not self.half_out:
            amax = self.output(i).abs().amax().clamp_min(1e-30)
            self.packs[i][1].copy_(E4M3_MAX / (amax * 1.0625))


def fp8_outlier_error(torch, args):
    """The FA3 paper's FP8 accuracy test (section 4.3): Q, K, V ~ N(0,1) + N(0,100)·Bernoulli(0.001)
    (each entry gets an extra N(0, 10²) term with probability 0.1 %, as `Case::inputs_with_outliers`
    draws them), OUTLIER_SHAPE, not causal, rounded to --dtype as the sweep's inputs come in; RMSE of
    each FP8 peer's O (float32) against attention in float64 on those rounded inputs.
    Returns [(impl, n, d, rmse)] for cudnn-fp8 and triton-fp8 among --impl (those that run)."""
    b, h, n, d = OUTLIER_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(OUTLIER_SEED)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]

    def draw():
        x = torch.randn(OUTLIER_SHAPE, generator=gen, device="cuda", dtype=torch.float64)
        hit = torch.rand(OUTLIER_SHAPE, generator=gen, device="cuda", dtype=torch.float64) < OUTLIER_P
        extra = torch.randn(OUTLIER_SHAPE, generator=gen, device="cuda", dtype=torch.float64)
        return (x + hit * (OUTLIER_STD * extra)).to(dtype)
    q, k, v = draw(), draw(), draw()
    ref = torch.empty(OUTLIER_SHAPE, device="cuda", dtype=torch.float64)
    for j in range(h):  # one head at a time: its n × n float64 scores are 128 MiB
        s = (q[0, j].double() @ k[0, j].double().T) / math.sqrt(d)
        ref[0, j] = torch.softmax(s, dim=-1) @ v[0, j].double()
    out = []
    impls = [i for i in ("cudnn-fp8", "triton-fp8") if i in args.impl]
    if not impls:
        print("fp8 outlier error: neither cudnn-fp8 nor triton-fp8 is in --impl", file=sys.stderr)
    for impl in impls:
        try:
            try:
                if impl == "cudnn-fp8":  # not checked against SDPA: its error is what is measured
                    step = CudnnFp8(torch, [(q, k, v, None)], False, args, check=False)
                    step.calibrate(0)
                    got = step.output(0)
                else:
                    step = make_step(torch, impl, [(q, k, v, None)], False, "fwd", d, args)
                    got = step(0).float()  # the tutorial's e5m2 O (no scales)
            except Skip:
                raise
            except Exception as e:  # noqa: BLE001 - a peer failing here is reported, not a crash
                raise Skip(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        except Skip as e:
            print(f"fp8 outlier error: {impl} skipped: {e}", file=sys.stderr)
            continue
        err = got.double() - ref
        rmse = err.square().mean().sqrt().item()
        rel = (err.norm() / ref.norm()).item()
        print(f"fp8 outlier error: {impl:<11} n={n} d={d} b={b} h={h}: RMSE {rmse:.3e} "
              f"(relative L2 {rel:.3e})", file=sys.stderr)
        out.append((impl, n, d, rmse))
        del step, got, err
    return out


def time_case(torch, backend, impl, sets, causal, direction, d, args, window=None, score_mod=None,
              mask_mod=None):
    """Median ms per call of one case; raises Skip with the reason when it does not run."""
    if direction == "decode" and impl == "flashinfer":
        make = lambda: make_flashinfer_decode_step(  # noqa: E731
            torch, sets, sets[0][0].shape[1] != sets[0][1].shape[1], args.dtype)
    elif direction == "decode":
        make = lambda: make_decode_step(torch, sets, sets[0][0].shape[1] != sets[0][1].shape[1])  # noqa: E731
    else:
        make = lambda: make_step(torch, impl, sets, causal, direction, d, args, window, score_mod,  # noqa: E731
                                 mask_mod)
    from torch.nn.attention import sdpa_kernel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                step = make()
                return measure(torch, step, len(sets), args.warmup, args.repeats, args.case_budget_s * 1e3)
        except Skip:
            raise
        except Exception as e:  # noqa: BLE001 - a backend refusing a shape is a skip, not a crash
            text = str(e).strip()
            why = [f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"]
            # SDPA says why a backend declined in warnings ("... kernel not used because ...").
            why += [str(w.message).strip().splitlines()[0] for w in caught
                    if "because" in str(w.message) or "requires" in str(w.message)][:2]
            torch.cuda.empty_cache()
            raise Skip("; ".join(why)) from None


def impls_for(impls, window, score_mod, mask_mod=None):
    """The peers among `impls` that take `window`, `score_mod` and `mask_mod` (all when they are
    none)."""
    return [i for i in impls if (window is None or i in WINDOW_IMPLS)
            and (score_mod is None or i in SCORE_MOD_IMPLS)
            and (mask_mod is None or i in MASK_MOD_IMPLS)]


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device found: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend
    backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not importable"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    csv_path, meta_path = os.path.join(args.out, "peers.csv"), os.path.join(args.out, "meta.json")
    card = torch.cuda.get_device_name()
    torch_desc = (f"{torch.__version__} (CUDA {torch.version.cuda}, "
                  f"cuDNN {torch.backends.cudnn.version()}, triton {triton_version})")
    fields = {}
    if "flashinfer" in args.impl and args.decode:
        # Its version (or why it is absent) under its own key, and beside triton's in `torch`.
        fields["flashinfer"] = flashinfer_version()
        if not fields["flashinfer"].startswith("flashinfer not importable"):
            torch_desc = torch_desc[:-1] + f", flashinfer {fields['flashinfer']})"
    cudnn_fp8 = "cudnn-fp8" in args.impl and ("fwd" in args.direction or args.fp8_outlier_error)
    if cudnn_fp8:
        # The frontend's version and its cuDNN (or why it is absent), as for FlashInfer.
        fields["cudnn_frontend"] = cudnn_version(torch)
        if not fields["cudnn_frontend"].startswith("cudnn (nvidia-cudnn-frontend) not importable"):
            torch_desc = torch_desc[:-1] + f", cudnn-frontend {fields['cudnn_frontend']})"
    fields["torch"] = torch_desc
    merge_meta(meta_path, fields, {
        "card": card,
        "cuda": torch.version.cuda or "",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    })
    print(f"peers: {card}, torch {torch_desc}, {args.dtype}", file=sys.stderr)

    prefill = [x for x in args.direction if x != "decode"]
    decode_impls = [i for i in args.impl if i in DECODE_IMPLS]
    if args.decode and len(decode_impls) < len(args.impl):
        left_out = ", ".join(i for i in args.impl if i not in DECODE_IMPLS)
        print(f"note: decode leaves out {left_out} (prefill kernels)", file=sys.stderr)
    total = (len(args.layout) * len(args.d) * len(args.n) * len(args.causals) * len(prefill)
             * sum(len(impls_for(args.impl, w, m, k)) for w in args.windows for m in args.score_mods
                   for k in args.mask_mods)
             + len(args.decode_d) * len(args.decode) * len(decode_impls))
    done, rows, results = 0, [], []
    shapes = [(layout, d, n) for layout in args.layout for d in args.d for n in args.n]
    for layout, d, n in shapes if prefill else []:
        batch, heads = dims(args, d, n)
        shape = (batch, heads, n, d)
        # Q, K, V and (for backward) dO per set; uniform in [-1, 1) like `ladder bench`; for
        # bshd laid out [b, s, h, d] and handed over as [b, h, s, d] views.
        tensors = 4 if "bwd" in prefill else 3
        nsets = sets_for(tensors * math.prod(shape) * 2)
        sets = []
        for _ in range(nsets):
            if layout == "bshd":
                ts = [torch.empty((batch, n, heads, d), device="cuda", dtype=dtype)
                      .uniform_(-1, 1).transpose(1, 2) for _ in range(tensors)]
            else:
                ts = [torch.empty(shape, device="cuda", dtype=dtype).uniform_(-1, 1)
                      for _ in range(tensors)]
            sets.append(tuple(ts) if tensors == 4 else (*ts, None))
        masks = [(c, w, m, k) for c in args.causals for w in args.windows for m in args.score_mods
                 for k in args.mask_mods]
        for causal, window, score_mod, mask_mod in masks:
            for direction in prefill:
                for impl in impls_for(args.impl, window, score_mod, mask_mod):
                    done += 1
                    name = impl if layout == "bhsd" else f"{impl}/{layout}"
                    mask = mask_label(causal, window, score_mod, mask_mod)
                    key = (name, direction, args.dtype, d, n, mask)
                    label = (f"[{done:>3}/{total}] {name:<15} {direction} {args.dtype} d={d:<3} "
                             f"n={n:<5} {mask:<6} b={batch} h={heads}")
                    try:
                        if layout != "bhsd" and impl.startswith("triton"):
                            raise Skip("the Triton tutorial kernel takes contiguous [b, h, s, d]")
                        ms = time_case(torch, backends.get(impl), impl, sets, causal, direction, d, args,
                                       window, score_mod, mask_mod)
                    except Skip as e:
                        results.append((key, str(e)))
                        print(f"{label}  skipped: {e}", file=sys.stderr)
                        continue
                    row = csv_row(impl, direction, args.dtype, causal, batch, heads, n, d, ms, layout,
                                  window, score_mod, mask_mod)
                    rows.append(row)
                    results.append((key, (ms, float(row["tflops"]))))
                    print(f"{label}  {ms:>9.4f} ms  {float(row['tflops']):>7.1f} TFLOP/s", file=sys.stderr)
                    write_csv(csv_path, rows)  # after every case: a cut-short run keeps its rows
        del sets
        torch.cuda.empty_cache()
    elem = 2  # fp16 and bf16
    for d in args.decode_d if decode_impls else []:
        for batch, heads_q, heads_kv, n in args.decode:
            q_shape, kv_shape = (batch, heads_q, 1, d), (batch, heads_kv, n, d)
            kv_bytes = 2 * math.prod(kv_shape) * elem
            nsets = sets_for(kv_bytes + math.prod(q_shape) * elem)
            try:
                sets = [tuple(torch.empty(s, device="cuda", dtype=dtype).uniform_(-1, 1)
                              for s in (q_shape, kv_shape, kv_shape)) for _ in range(nsets)]
            except torch.cuda.OutOfMemoryError as e:
                sets = None
                oom = f"OutOfMemoryError: {str(e).splitlines()[0]}"
            for impl in decode_impls:
                done += 1
                key = (impl, "decode", args.dtype, d, f"1x{n}", "full")
                label = (f"[{done:>3}/{total}] {impl:<15} decode {args.dtype} d={d:<3} L={n:<6} "
                         f"b={batch:<2} h={heads_q}/{heads_kv}")
                try:
                    if sets is None:
                        raise Skip(oom)
                    ms = time_case(torch, backends.get(impl), impl, sets, False, "decode", d, args)
                except Skip as e:
                    results.append((key, str(e)))
                    print(f"{label}  skipped: {e}", file=sys.stderr)
                    continue
                row = decode_row(impl, args.dtype, batch, heads_q, heads_kv, 1, n, d, ms, elem)
                rows.append(row)
                results.append((key, (ms, float(row["tflops"]), float(row["tbps"]))))
                print(f"{label}  {ms:>9.4f} ms  {float(row['tbps']):>6.2f} TB/s", file=sys.stderr)
                write_csv(csv_path, rows)
            del sets
            torch.cuda.empty_cache()
    write_csv(csv_path, rows)
    if TRITON_CONFIGS:
        config_path = os.path.join(args.out, "triton-configs.csv")
        with open(config_path, "w", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            w.writerow(["d", "n", "causal", "warp_specialize", "forward_config"])
            w.writerows(TRITON_CONFIGS)
        print(f"wrote {config_path}", file=sys.stderr)
    if args.fp8_outlier_error:
        errors = fp8_outlier_error(torch, args)
        error_path = os.path.join(args.out, "fp8-error.csv")
        with open(error_path, "w", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            w.writerow(["impl", "n", "d", "rmse"])
            w.writerows([(impl, n, d, f"{rmse:.6e}") for impl, n, d, rmse in errors])
        print(f"wrote {error_path}", file=sys.stderr)
    # Keep the note's other parts (ladder bench's); replace peers.py's own.
    with open(meta_path) as fh:
        old = json.load(fh).get("note", "")
    note = (f"peers.py: median of {args.repeats} CUDA-event samples after {args.warmup} warm-up calls, "
            f"triton warp_specialize={args.triton_warp_specialize}")
    if TRITON_CONFIGS:
        note += (", triton: first call checked against SDPA (max abs), its autotuned forward "
                 "configurations in triton-configs.csv")
    if cudnn_fp8 and _cudnn and not isinstance(_cudnn[0], Skip):
        o_type = args.dtype if cudnn_fp8_half_out(torch, _cudnn[0]) else "e4m3 (scale_o = 1 / descale_v)"
        note += (f", cudnn-fp8: pygraph.sdpa_fp8 (cudnn-frontend {fields['cudnn_frontend']}), e4m3 Q, K, V "
                 f"with one scale per tensor (448 / amax), quantised untimed, O in {o_type}")
    if "flashinfer" in decode_impls:
        note += (f", flashinfer: BatchDecodeWithPagedKVCacheWrapper (CUDA-core decode, programmatic "
                 f"dependent launch on sm_90+), HND pages of {FLASHINFER_PAGE_SIZE} over the contiguous cache")
    kept = [part for part in old.split("; ") if part and not part.startswith("peers.py:")]
    merge_meta(meta_path, {"note": "; ".join(kept + [note])}, {})
    print(render(results))
    skipped = sum(isinstance(o, str) for _, o in results)
    print(f"{len(results)} cases: {len(results) - skipped} measured, {skipped} skipped; wrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
