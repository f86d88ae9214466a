#!/usr/bin/env python
"""CLI of `rocketkv_eval.e2e` (see its docstring for what it measures)."""

import sys

from rocketkv_eval.e2e import main

if __name__ == "__main__":
    sys.exit(main())
