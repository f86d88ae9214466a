"""A decode engine without this package, for ``test_pd_faults.py``:

    python tests/pd_plain_decode_child.py MODEL IN.json OUT.json

vLLM alone (``VLLM_PLUGINS`` names none of ours, set before vLLM is
imported: no ROCKETKV backend, no patch), its own attention backend,
vLLM's NixlConnector in pull mode. IN.json holds prompts and the
``kv_transfer_params`` of each (null: a local request); the engine runs
them in one batch and writes each output's finish reason and tokens to
OUT.json. What a user gets who sends a ROCKETKV prefill engine's params to
a decode engine that never installed the package.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_PLUGINS"] = "none-of-rocketkv"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process


def main(model: str, requests_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    requests = json.loads(open(requests_path).read())
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device="cpu",
            engine_id="plain-D",
        ),
    )
    outs = llm.generate(
        [{"prompt_token_ids": r["prompt"]} for r in requests],
        [
            SamplingParams(
                temperature=0.0,
                max_tokens=8,
                ignore_eos=True,
                extra_args=None if r["kv"] is None else {"kv_transfer_params": r["kv"]},
            )
            for r in requests
        ],
        use_tqdm=False,
    )
    loaded = sorted(
        name for name, mod in sys.modules.items() if name.startswith("rocketkv") and mod
    )
    result = {
        "rocketkv_modules": loaded,
        "outputs": [
            {"finish_reason": o.outputs[0].finish_reason, "token_ids": list(o.outputs[0].token_ids)}
            for o in outs
        ],
    }
    open(out_path, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
