"""RocketKV demo: answer a long needle-in-a-haystack prompt with a small KV budget.

    python scripts/demo.py                        # ROCKETKV, ~6000 tokens, budget 256
    python scripts/demo.py --backend CPU_ATTN     # dense baseline on CPU
    python scripts/demo.py --backend FLASH_ATTN   # dense baseline on GPU

Prepares the bundled SmolLM2-135M-Instruct offline (first run only), builds one
needle prompt, generates greedily and reports correctness, KV tokens kept per
KV head, and wall times. Exit status is 1 when the answer is wrong.

dtype: on an x86-64 CPU without native bf16 (neither ``avx512_bf16`` nor
``amx_bf16`` in /proc/cpuinfo: AVX2-only and AVX-512 CPUs before Cooper Lake)
the model runs in float32, and the demo says so: vLLM's CPU build then has no
bf16 kernels (it loads ``_C_AVX2`` or ``_C_AVX512``, not ``_C``, and its
attention converts bf16 in software), and one 6,000-token prompt in bf16 took
about 4 minutes on a 2-core AVX2 machine. Elsewhere the checkpoint's dtype
(bf16). ``--dtype`` overrides the rule; ``ROCKETKV_DEMO_CPU_FLAGS`` (a
space-separated flag list) replaces /proc/cpuinfo's flags, to try the rule as
another CPU would (``ROCKETKV_DEMO_CPU_FLAGS=avx2`` takes the float32 path).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Iterable
from typing import Any

# Everything is local; never let transformers/vLLM reach for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MAX_MODEL_LEN = 8192

# CPU flags (as /proc/cpuinfo names them) of native bf16 arithmetic: vLLM's CPU
# build loads its bf16 kernels (``vllm._C``) only where
# torch.cpu._is_avx512_bf16_supported(), and its AMX attention needs amx_bf16.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
X86_64 = ("x86_64", "amd64")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ``flags`` of /proc/cpuinfo's text (x86; the first processor's)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def choose_dtype(
    requested: str | None, machine: str, flags: Iterable[str] | None
) -> tuple[str, str]:
    """The demo's model dtype on a CPU, and why (pure: flags in, dtype out).

    ``requested`` is ``--dtype`` (wins when given), ``machine`` is
    platform.machine(), ``flags`` the CPU's flags (None: unknown). An x86-64
    CPU without native bf16 gets ``float32``; anything else ``auto``: vLLM's
    choice, the checkpoint's dtype (bf16 for the demo model). Returns the dtype
    for ``LLM(dtype=...)`` and the reason, worded to follow "because"."""
    if requested:
        return requested, "--dtype asks for it"
    if machine.lower() not in X86_64:
        return "auto", f"this is not an x86-64 CPU ({machine})"
    if flags is None:
        return "auto", "this CPU's flags are unknown (no /proc/cpuinfo)"
    native = [f for f in NATIVE_BF16_FLAGS if f in set(flags)]
    if native:
        return "auto", f"this CPU has native bf16 ({', '.join(native)})"
    return "float32", (
        "this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16 in its flags), "
        "where vLLM's CPU bf16 path has no kernels and is several times slower"
    )


def read_cpu_flags() -> set[str] | None:
    """This CPU's flags: ``ROCKETKV_DEMO_CPU_FLAGS`` if set, else /proc/cpuinfo's."""
    forced = os.environ.get("ROCKETKV_DEMO_CPU_FLAGS")
    if forced is not None:
        return set(forced.split())
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_flags(f.read())
    except OSError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens", type=int, default=6000, help="target prompt length in tokens (default 6000)"
    )
    p.add_argument(
        "--depth",
        type=float,
        default=0.5,
        help="needle position, 0.0=start .. 1.0=end (default 0.5)",
    )
    p.add_argument("--seed", type=int, default=0, help="haystack/secret seed")
    p.add_argument("--budget", type=int, default=256, help="RocketKV token budget (default 256)")
    p.add_argument(
        "--prompt-budget",
        type=int,
        default=None,
        help="explicit RocketKV prompt budget (overrides --budget)",
    )
    p.add_argument(
        "--backend", default="ROCKETKV", help="vLLM attention backend name (default ROCKETKV)"
    )
    p.add_argument(
        "--model", default=None, help="model path/name (default: the prepared SmolLM2-135M)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="max new tokens (default 16)")
    p.add_argument(
        "--dtype",
        default=None,
        help="model dtype; default: float32 on an x86-64 CPU without native bf16, "
        "else vLLM's choice (the checkpoint's)",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="disable compilation/graphs (default: on for CPU only)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache size; default 1 GiB on CPU, vLLM's choice on GPU",
    )
    return p.parse_args(argv)


def is_rocketkv(backend: str) -> bool:
    return backend.upper() == "ROCKETKV"


def rocketkv_config(args: argparse.Namespace) -> dict[str, int]:
    if args.prompt_budget is not None:
        return {"prompt_budget": args.prompt_budget}
    return {"token_budget": args.budget}


def kept_tokens(llm: Any, backend: str, num_prompt_tokens: int) -> str:
    """KV tokens kept per KV head for this prompt, as a printable string."""
    if not is_rocketkv(backend):
        return f"{num_prompt_tokens} (dense backend keeps all)"
    from rocketkv_vllm.engine import kept_tokens_for_prompt

    return str(kept_tokens_for_prompt(llm.llm_engine.vllm_config, num_prompt_tokens))


def dtype_for(args: argparse.Namespace, on_cpu: bool) -> tuple[str, str]:
    """``choose_dtype`` for this machine; on a GPU only ``--dtype`` counts."""
    if not on_cpu:
        return (args.dtype, "--dtype asks for it") if args.dtype else ("auto", "on a GPU")
    dtype, why = choose_dtype(args.dtype, platform.machine(), read_cpu_flags())
    if not args.dtype and "ROCKETKV_DEMO_CPU_FLAGS" in os.environ:
        why += " [flags from ROCKETKV_DEMO_CPU_FLAGS]"
    return dtype, why


def build_llm_kwargs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    kwargs: dict[str, Any] = {
        "model": model,
        "attention_backend": args.backend,
        "max_model_len": MAX_MODEL_LEN,
        # Compilation buys nothing for a one-prompt demo on CPU but costs
        # minutes of start-up; on GPU keep vLLM's default (graphs).
        "enforce_eager": on_cpu if args.enforce_eager is None else args.enforce_eager,
    }
    kwargs["dtype"] = dtype_for(args, on_cpu)[0]
    # On CPU vLLM otherwise reserves 92% of the NUMA node's RAM up front and
    # refuses to start when other processes use memory; an 8k-token cache
    # for this model needs well under 1 GiB.
    gib = args.kv_cache_gib if args.kv_cache_gib is not None else (1.0 if on_cpu else None)
    if gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(gib * (1 << 30))
    if is_rocketkv(args.backend):
        kwargs["additional_config"] = {"rocketkv": rocketkv_config(args)}
    return kwargs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokens + args.max_tokens > MAX_MODEL_LEN:
        sys.exit(f"--tokens + --max-tokens must be <= {MAX_MODEL_LEN}")

    from vllm.platforms import current_platform

    from rocketkv_eval.needle import build_needle_prompt, is_correct

    # One line before the minutes of work: which dtype, and why.
    dtype, why = dtype_for(args, current_platform.is_cpu())
    label = "auto (the checkpoint's, vLLM's choice)" if dtype == "auto" else dtype
    print(f"dtype: {label}, because {why}", flush=True)

    t0 = time.perf_counter()
    if args.model is None:
        from rocketkv_eval.model import prepare_default_model

        model = prepare_default_model()
    else:
        model = args.model
    t_prep = time.perf_counter() - t0

    from vllm import LLM, SamplingParams

    kwargs = build_llm_kwargs(args, model)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t_load = time.perf_counter() - t0

    # Tokenize with the engine's own tokenizer and pass ids, so the counted
    # prompt is exactly what runs (no second BOS for BOS-adding tokenizers).
    case = build_needle_prompt(llm.get_tokenizer(), args.tokens, args.depth, seed=args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": case.token_ids}, params)[0]
    t_gen = time.perf_counter() - t0

    text = out.outputs[0].text
    ok = is_correct(text, case)
    n_prompt = len(out.prompt_token_ids)
    print("=" * 60)
    print(f"model            : {model}")
    print(
        f"backend          : {args.backend}"
        + (f"  rocketkv={rocketkv_config(args)}" if is_rocketkv(args.backend) else "")
    )
    print(f"needle           : {case.answer!r} at depth {case.depth}")
    print(f"answer           : {text.strip()!r}")
    print(f"correct          : {'YES' if ok else 'NO'}")
    print(f"dtype            : {llm.llm_engine.vllm_config.model_config.dtype}")
    print(f"prompt tokens    : {n_prompt}")
    print(f"kept per KV head : {kept_tokens(llm, args.backend, n_prompt)}")
    if args.model is None:
        print(f"model prepare    : {t_prep:.1f} s")
    print(f"model load       : {t_load:.1f} s")
    print(f"generate         : {t_gen:.1f} s")
    print("=" * 60)
    return 0 if ok else 1


if __name__ == "__main__":  # required: vLLM spawns worker processes
    sys.exit(main())
