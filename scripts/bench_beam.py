#!/usr/bin/env python
"""CLI of `rocketkv_eval.bench_beam` (see its docstring for what it measures)."""

import sys

from rocketkv_eval.bench_beam import main

if __name__ == "__main__":
    sys.exit(main())
