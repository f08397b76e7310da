"""TorchTitan side of titan_rl: ModelSpec, parallelize function, state-dict adapter.

Importing this package installs the CPU shims (cpu_compat.apply(), a no-op where an
accelerator exists) before anything imports torchtitan. Import the submodules you need:
`titan_rl.titan.spec.model_spec`, `titan_rl.titan.parallelize`, ...
"""

from titan_rl.titan import cpu_compat

cpu_compat.apply()
