"""What the exact GDN kernel costs: exact recurrent vs plain chunkwise-parallel, side by side.

    python scripts/bench_gdn.py [--json OUT] [--repeats 3] [--dtype float32] [--threads N]

For shapes like the debug / small hybrid flavors (dk = dv = 64), on CPU, one run:
  train:   forward+backward of gdn_recurrent (exact forward, chunked backward) vs
           gdn_chunked forward+backward (autograd), B sequences of length L;
  prefill: forward only (no grad), exact vs chunked;
  decode:  one token for each of B sequences with a state, exact (one recurrent step)
           vs gdn_chunked called with one-token sequences.
ratio = exact time / chunked time (1.0 = free). Also the max |o| difference between the
two forms (fp32 and bf16 inputs), since the chunked form is not bitwise equal. Prints a
table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from titan_rl.jsonout import write_json
from titan_rl.kernels.gdn import gdn_chunked, gdn_recurrent, l2norm, lane_stable

SHAPES = {  # name: (B, L, Hk, Hv, dk, dv)
    "debug": (8, 128, 2, 4, 64, 64),
    "small": (16, 256, 4, 8, 64, 64),
}


def _inputs(B, L, Hk, Hv, dk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = B * L
    q = l2norm(torch.randn(T, Hk, dk, generator=g)).to(dtype)
    k = l2norm(torch.randn(T, Hk, dk, generator=g)).to(dtype)
    v = torch.randn(T, Hv, dv, generator=g).to(dtype)
    gl = -lane_stable(F.softplus, torch.randn(T, Hv, generator=g) - 2)
    beta = lane_stable(torch.sigmoid, torch.randn(T, Hv, generator=g))
    cu = torch.arange(0, T + 1, L, dtype=torch.long)
    return q, k, v, gl, beta, cu


def _best(fn, repeats):
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def bench_shape(name, shape, dtype, repeats):
    B, L, Hk, Hv, dk, dv = shape
    q, k, v, g, beta, cu = _inputs(*shape, dtype)
    ops = {"exact": gdn_recurrent, "chunked": gdn_chunked}
    res = {"shape": dict(B=B, L=L, Hk=Hk, Hv=Hv, dk=dk, dv=dv)}

    def train(op):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
        o, s = op(*xs, cu)
        (o.float().square().mean() + s.square().mean()).backward()

    res["train"] = {e: _best(lambda e=e: train(ops[e]), repeats) for e in ops}
    with torch.no_grad():
        res["prefill"] = {e: _best(lambda e=e: ops[e](q, k, v, g, beta, cu), repeats) for e in ops}
        _, state = gdn_recurrent(q, k, v, g, beta, cu)
        d = _inputs(B, 1, Hk, Hv, dk, dv, dtype, seed=1)
        dcu = torch.arange(B + 1, dtype=torch.long)
        steps = 20
        res["decode"] = {e: _best(lambda e=e: [ops[e](*d[:5], dcu, state) for _ in range(steps)], repeats) / steps
                         for e in ops}
    for k_ in ("train", "prefill", "decode"):
        res[k_]["ratio"] = res[k_]["exact"] / res[k_]["chunked"]
    tokens = {"train": B * L, "prefill": B * L, "decode": B}
    res["tokens"] = tokens
    # chunked vs recurrent difference (not bitwise equal, by design)
    diff = {}
    with torch.no_grad():
        for dt in (torch.float32, torch.bfloat16):
            x = _inputs(*shape, dt, seed=2)
            (oe, se), (oc, sc) = gdn_recurrent(*x), gdn_chunked(*x)
            diff[str(dt).replace("torch.", "")] = {
                "o_max_abs": (oe.float() - oc.float()).abs().max().item(),
                "o_max": oe.float().abs().max().item(),
                "state_max_abs": (se - sc).abs().max().item(),
            }
    res["chunked_vs_exact"] = diff
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="debug,small", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    dtype = getattr(torch, args.dtype)
    res = {"dtype": args.dtype, "threads": torch.get_num_threads(), "repeats": args.repeats, "shapes": {}}
    for name in args.shapes.split(","):
        res["shapes"][name] = bench_shape(name, SHAPES[name], dtype, args.repeats)
    print(f"\n{'shape':8s}{'what':10s}{'exact ms':>11s}{'chunked ms':>12s}{'ratio':>8s}   (B, L, Hk, Hv, dk, dv)")
    for name, r in res["shapes"].items():
        for k in ("train", "prefill", "decode"):
            print(f"{name:8s}{k:10s}{1e3 * r[k]['exact']:>11.2f}{1e3 * r[k]['chunked']:>12.2f}{r[k]['ratio']:>7.2f}x"
                  f"   {tuple(r['shape'].values())}" + ("  per step" if k == "decode" else ""))
    print(f"\n{'shape':8s}{'inputs':10s}{'max|o_exact - o_chunked|':>26s}{'max|o|':>9s}{'max|dS|':>11s}")
    for name, r in res["shapes"].items():
        for dt, d in r["chunked_vs_exact"].items():
            print(f"{name:8s}{dt:10s}{d['o_max_abs']:>26.2e}{d['o_max']:>9.2f}{d['state_max_abs']:>11.2e}")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
