#!/usr/bin/env python
"""Compile the Triton kernels for NVIDIA GPUs on a machine without one.

CLI of `rocketkv_eval.compile_kernels` (see its docstring for what it reports); where
rocketkv_eval is not installed: PYTHONPATH=<repo>:<repo>/eval.
"""

import sys

from rocketkv_eval.compile_kernels import main

if __name__ == "__main__":
    sys.exit(main())
