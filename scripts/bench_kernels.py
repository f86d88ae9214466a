#!/usr/bin/env python
"""Per-layer decode attention time: vLLM's own kernels vs ours vs RocketKV.

CLI of `rocketkv_eval.bench_kernels` (see its docstring for what it measures); where
rocketkv_eval is not installed: PYTHONPATH=<repo>:<repo>/eval.
"""

import sys

from rocketkv_eval.bench_kernels import main

if __name__ == "__main__":
    sys.exit(main())
