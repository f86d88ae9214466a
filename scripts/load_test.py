#!/usr/bin/env python
"""CLI of `rocketkv_eval.load_test` (see its docstring for what it measures)."""

import sys

from rocketkv_eval.load_test import main

if __name__ == "__main__":
    sys.exit(main())
