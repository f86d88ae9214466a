#!/usr/bin/env python
"""RocketKV demo: answer a long needle-in-a-haystack prompt with a small KV budget.

CLI of `rocketkv_eval.demo` (see its docstring for the options); `make demo` runs it.
"""

import sys

from rocketkv_eval.demo import main

if __name__ == "__main__":  # required: vLLM spawns worker processes
    sys.exit(main())
