#!/usr/bin/env python
"""How much true attention a page selection keeps, on a real prompt.

CLI of `rocketkv_eval.page_recall` (see its docstring for what it measures).
"""

import sys

from rocketkv_eval.page_recall import main

if __name__ == "__main__":
    sys.exit(main())
