#!/usr/bin/env python3
"""Time the peers on `ladder bench --varlen`'s packed batch, into OUT/varlen-peers.csv.

The batch (as crates/compare/src/bench/varlen.rs draws it): 64 sequences of 128 … 4096 tokens,
sequence i of length 128 + mix(i) % 3969 with mix SplitMix64's finaliser of i + 1, each attending
to itself, q, k, v packed [total, heads, d] (heads = hidden / d), fp16 or bf16. FLOPs are the real
ones, summed over the sequences.

Peers (each skipped, with its reason, if this torch refuses it):
  flash-varlen    torch.ops.aten._flash_attention_forward with cu_seqlens: the FlashAttention-2
                  varlen kernel PyTorch ships (what flash_attn_varlen_func runs)
  sdpa-njt        F.scaled_dot_product_attention on nested jagged tensors (the public varlen API;
                  SDPA picks the backend)
  flex-doc        FlexAttention with a document mask (and causal within a document), compiled,
                  its block mask built once outside the timed region

Timing: scripts/peers.py's `measure` (one untimed call, warm-up, CUDA events, median).

    python3 scripts/peers_varlen.py --out bench-results [--d 128] [--causal both] [--dtype fp16]
"""
import argparse
import csv
import itertools
import math
import os
import sys

from peers import measure  # scripts/peers.py: the same timing as every other peer

SEQUENCES, SHORTEST, LONGEST = 64, 128, 4096
HEADER = ["imp", "batching", "dtype", "causal", "sequences", "heads", "d", "tokens", "gflop", "ms",
          "tflops"]
MASK64 = (1 << 64) - 1


def lengths(count=SEQUENCES, lo=SHORTEST, hi=LONGEST):
    """ladder bench --varlen's lengths (bench/varlen.rs, `lengths`)."""
    out = []
    for i in range(count):
        x = ((i + 1) * 0x9E3779B97F4A7C15) & MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
        x ^= x >> 31
        out.append(lo + x % (hi - lo + 1))
    return out


def flops(n, heads, d, causal):
    """4·n²·d per head, halved under the mask (ladder_compare::results::attention_flops)."""
    pairs = n * n / 2 if causal else n * n
    return 4.0 * heads * pairs * d


def steps(torch, q, k, v, lens, causal):
    """(name, call) for each peer; a peer that cannot be set up yields its error instead."""
    F = torch.nn.functional
    dev = q.device
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    longest = max(lens)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)

    def flash_varlen():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal,
                                                      False, scale=scale)[0]
    yield "flash-varlen", flash_varlen

    try:
        offsets = cu.to(torch.int64)
        nest = lambda t: torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
        qn, kn, vn = nest(q), nest(k), nest(v)

        def njt():
            return F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)
        yield "sdpa-njt", njt
    except Exception as e:  # noqa: BLE001 - reported as a skip
        yield "sdpa-njt", e

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = torch.repeat_interleave(torch.arange(len(lens), device=dev),
                                      torch.tensor(lens, device=dev))

        def mask(b, h, qi, ki):
            same = doc[qi] == doc[ki]
            return (same & (qi >= ki)) if causal else same
        total = q.shape[0]
        # _compile: the mask is evaluated block by block, never as a dense [total, total] tensor.
        block_mask = create_block_mask(mask, None, None, total, total, device=dev, _compile=True)
        flex = torch.compile(flex_attention, dynamic=False)
        # [1, heads, total, d] views of the packed tensors (strided, no copy).
        qf, kf, vf = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))

        def flex_doc():
            return flex(qf, kf, vf, block_mask=block_mask)
        yield "flex-doc", flex_doc
    except Exception as e:  # noqa: BLE001
        yield "flex-doc", e


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results")
    p.add_argument("--d", default="128", help="head dims, comma-separated [128]")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / d [2048]")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(argv)
    lens = lengths()
    assert lens[:3] == [1026, 3881, 1488], "the draw must match ladder bench --varlen's"
    import torch
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    total = sum(lens)
    causals = {"both": [False, True], "true": [True], "false": [False]}[a.causal]
    rows = []
    print(f"varlen peers: torch {torch.__version__}, {SEQUENCES} sequences, {total} tokens",
          file=sys.stderr)
    for d in [int(x) for x in a.d.split(",")]:
        heads = max(1, a.hidden // d)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(total, heads, d, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(3))
        for causal in causals:
            flop = sum(flops(n, heads, d, causal) for n in lens)
            for name, call in steps(torch, q, k, v, lens, causal):
                if isinstance(call, Exception):
                    print(f"skip {name} d={d} causal={causal}: {type(call).__name__}: {call}",
                          file=sys.stderr)
                    continue
                try:
                    # One input set: the batch is far larger than L2.
                    ms = measure(torch, lambda _: call(), 1, a.warmup, a.repeats, 3000.0)
                except Exception as e:  # noqa: BLE001
                    msg = str(e).splitlines()[0] if str(e) else ""
                    print(f"skip {name} d={d} causal={causal}: {type(e).__name__}: {msg}",
                          file=sys.stderr)
                    continue
                tflops = flop / (ms * 1e-3) / 1e12
                print(f"{name:<13} d={d} causal={causal}: {ms:.3f} ms, {tflops:.0f} TFLOP/s",
                      file=sys.stderr)
                rows.append([name, "varlen", a.dtype, str(causal).lower(), SEQUENCES, heads, d, total,
                             f"{flop / 1e9:.3f}", f"{ms:.4f}", f"{tflops:.1f}"])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "varlen-peers.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerows(rows)


if __name__ == "__main__":
    main()
