"""For tests/test_engine_link.py, run as `python tests/_separate_corrupt.py RUN_DIR` in a fresh
process (an engine in its own process cannot start from one that ran an in-process engine).

A separate engine (rollout.placement = "separate") of the GDN hybrid (qwen3_hybrid debug, bf16:
GDN layers and a standard attention layer, so both kinds of operand): step 1 syncs untouched;
at step 2 the engine's first GDN input projection (the GEMM weight it multiplies by) is changed
in its own process through the worker extension (titan_corrupt_operand) once the transfer is
loaded, before it checks; step 3 untouched again; step 4 the same for the attention layer's
fused q/k/v, step 6 for the LM head's copy. One engine start serves them all (each start is
tens of seconds of the suite). Prints one line per sync: "PASSED <arch> <step>" or
"STOPPED <arch> <step> <the RunStopped message>" (a message of one line).
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from titan_rl import config  # noqa: E402
from titan_rl.errors import RunStopped  # noqa: E402
from titan_rl.registry import get_architecture  # noqa: E402
from titan_rl.rl.ranks import Ranks  # noqa: E402
from titan_rl.rl.separate_engines import SeparateEngines  # noqa: E402

SMALL = ["--rollout.kv_cache_mib=32", "--rollout.max_model_len=64", "--rollout.max_num_seqs=4",
         "--algorithm.prompts_per_step=2", "--algorithm.group_size=2"]


CASES = [  # (architecture, flavor, [(step, the operand changed before its check, or None)])
    ("qwen3_hybrid", "debug_hybrid", [(1, None), (2, "model.layers.0.linear_attn.in_proj_qkvz.gemm_weight"),
                                      (3, None), (4, "model.layers.3.self_attn.packed_qkv"), (5, None),
                                      (6, "lm_head.prepared")]),
]


def main(run_dir: str) -> None:
    for arch, flavor, steps in CASES:
        run(os.path.join(run_dir, arch), arch, flavor, steps)


def run(run_dir: str, arch: str, flavor: str, steps: list) -> None:
    cfg = config.load(None, [*SMALL, "--rollout.placement=separate", "--model.dtype=\"bfloat16\"",
                             f"--model.name={arch}", f"--model.flavor={flavor}"])
    model = get_architecture(cfg.model.name).build(cfg.model.flavor, cfg.model_options()).init_weights(1, 0.05)
    link = SeparateEngines(cfg, run_dir, model.to(torch.bfloat16), torch.bfloat16, Ranks(), "collective")
    try:
        link._start(1)
        for step, corrupt in steps:
            e = link.engines[0]
            real = e.sender.send_state
            if corrupt:
                def send_then_corrupt(*args, _real=real, _e=e, _name=corrupt):
                    sent = _real(*args)  # the engine has loaded it: now its prepared copy is changed
                    _e.llm.collective_rpc("titan_corrupt_operand", args=(_name,))
                    return sent

                e.sender.send_state = send_then_corrupt
            try:
                check = link.sync(step=step)  # both sides' digests, the engine's read in its process
                print(f"PASSED {arch} {step}" if check.engine == check.trainer else f"RETURNED {arch} {step}",
                      flush=True)
            except RunStopped as err:
                print(f"STOPPED {arch} {step} {err}".replace("\n", "\\n"), flush=True)
            finally:
                e.sender.send_state = real
    finally:
        link.close()


if __name__ == "__main__":
    main(sys.argv[1])
