#!/usr/bin/env python
"""ROCKETKV under vLLM's Ray executor gives one process's greedy tokens.

CLI of `rocketkv_eval.ray_check` (see its docstring for what it checks).
"""

import sys

from rocketkv_eval.ray_check import main

if __name__ == "__main__":
    sys.exit(main())
