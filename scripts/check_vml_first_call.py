"""MKL VML's first call of a process, split across OpenMP threads, against the same call after
`titan_rl.kernels` made the first one on one thread (kernels/mkl_vml.py), in fresh processes.

    python scripts/check_vml_first_call.py [--processes 100] [--threads 2] [--json OUT]

Each child computes cos of a [512, 64] fp32 tensor of RoPE angles (the size of one chunk of the
RoPE table, over ATen's 2048-element grain, so split across threads) as the first VML call it
makes, and compares it with cos in fp64 rounded to fp32 (a correct answer is within 1e-6 there).
A wrong child also says whether its wrong elements are, bit for bit, what MKL's vmsCos computes
in VML_EP mode (Enhanced Performance, about 11 correct bits). The two forms alternate, so
machine load affects both alike. A race: its rate depends on the machine and its load; 0 of N
bounds it, it does not prove it gone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from titan_rl.jsonout import write_json

CHILD = r"""
import ctypes, json, os, sys, torch
if sys.argv[1] == "after_import":
    import titan_rl.kernels  # noqa: F401  (its import makes VML's first call on one thread)
inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
emb = torch.cat([torch.arange(0, 512).float()[:, None] * inv[None, :]] * 2, -1)
got = emb.cos()
ref = emb.double().cos().float()
bad = (got - ref).abs() > 1e-6
out = {"wrong": int(bad.sum()), "threads": torch.get_num_threads()}
if out["wrong"]:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    ep = torch.empty_like(emb)
    lib.vmsCos(ctypes.c_int(emb.numel()), ctypes.c_void_p(emb.data_ptr()), ctypes.c_void_p(ep.data_ptr()),
               ctypes.c_ulonglong(0x3))  # VML_EP
    out["wrong_are_vml_ep"] = bool(torch.equal(got[bad], ep[bad]))
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=100, help="fresh processes per form")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    forms = ("first_call_split", "after_import")
    runs = {f: [] for f in forms}
    for i in range(args.processes):
        for form in forms:
            out = subprocess.run([sys.executable, "-c", CHILD, form], env=env, capture_output=True, text=True,
                                 timeout=300)
            if out.returncode != 0:
                raise SystemExit(f"child ({form}) failed:\n{out.stderr[-2000:]}")
            runs[form].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"\r{i + 1}/{args.processes} processes per form", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows = []
    for form in forms:
        wrong = [r for r in runs[form] if r["wrong"]]
        rows.append({"form": form, "processes": len(runs[form]), "wrong": len(wrong),
                     "wrong_are_vml_ep": sum(bool(r.get("wrong_are_vml_ep")) for r in wrong),
                     "wrong_elements": [r["wrong"] for r in wrong]})
    print(f"{'form':<18} {'processes':>9} {'wrong':>6} {'= VML_EP bits':>14}  wrong elements of 32768")
    for r in rows:
        print(f"{r['form']:<18} {r['processes']:>9} {r['wrong']:>6} {r['wrong_are_vml_ep']:>14}  {r['wrong_elements']}")
    if args.json:
        write_json(args.json, {"threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
