"""RocketKV settings: parsing, validation and the per-request budget plan.

Users pass settings through vLLM's own ``additional_config``::

    vllm serve M --attention-backend ROCKETKV \
        --additional-config '{"rocketkv": {"token_budget": 1024}}'

Everything here is pure Python so that the scheduler-side block manager and the
worker-side backend derive exactly the same plan for a request from its prompt
length alone (the block manager is told nothing else about a request).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources
from typing import Any

import yaml

CONFIG_KEY = "rocketkv"
KERNEL_CHOICES = ("auto", "torch", "triton")
KT_DTYPE_CHOICES = ("auto", "fp8_e4m3")
_MAX_INT = 1 << 24


class RocketKVConfigError(ValueError):
    """A RocketKV setting is missing, unknown or out of range."""


@dataclass(frozen=True)
class RocketKVConfig:
    """What the user asked for (one preset plus overrides), validated.

    ``token_budget`` switches on the automatic split of SPEC §1; otherwise the
    explicit knobs are used as given. The split derives prompt_budget, topk
    and topr, so an explicit value of those next to token_budget is refused
    (page_size may be given with it: the split is then computed for it).
    """

    token_budget: int | None = None
    prompt_budget: int = 2048
    window_size: int = 32
    kernel_size: int = 63
    page_size: int | None = None  # None: 4, or derived from token_budget
    topk: int = 256  # tokens selected per decode step (a multiple of page_size;
    # larger than the view: every page, i.e. attend to all kept tokens)
    topr: int | None = None  # None: head dim (all channels)
    max_new_tokens: int = 256  # generation length the token_budget split assumes
    # Not in the reference; cheap, and it keeps each new token's own page
    # (measured on SmolLM2: needle 8/9 with it, 6/9 without, token budget 256).
    # Selected on top of the topk pages (an extra page, never one of them).
    force_current_page: bool = True
    # Stage 1 on/off. False: nothing is evicted, but a prompt longer than
    # topk still gets Stage 2 over all its tokens (Quest-style sparse decode).
    evict: bool = True
    # auto: Triton on CUDA, the C++ kernel on CPU (PyTorch if it cannot be
    # built); torch: batched PyTorch; triton: Triton (tests force it on CPU).
    kernel: str = "auto"
    # KT pages (per-page min/max keys): "auto" stores them in the KV cache
    # dtype; "fp8_e4m3" in fp8 with a power-of-two scale per row, rounded
    # outward so they stay bounds (algorithm.kt_fp8): about half the bytes
    # to keep and to read when scoring pages.
    kt_dtype: str = "auto"
    free_evicted_blocks: bool = True  # give evicted blocks back to vLLM
    poison_evicted_blocks: bool = False  # tests: garbage-fill blocks before freeing
    # tests: lay decode steps out as a FULL CUDA graph replays them
    # (decode_graphs), also where vLLM captures none (CPU)
    force_graph_layout: bool = False
    preset: str | None = None


# (field, minimum, maximum); None bounds are checked elsewhere.
_INT_RANGES = {
    "token_budget": (16, _MAX_INT),
    "prompt_budget": (2, _MAX_INT),
    "window_size": (1, 4096),
    "kernel_size": (1, 4095),
    "page_size": (1, 256),
    "topk": (1, _MAX_INT),
    "topr": (1, 1024),
    "max_new_tokens": (1, _MAX_INT),
}


def token_budget_range() -> tuple[int, int]:
    return _INT_RANGES["token_budget"]


def _fail(field_name: str, value: Any, allowed: str) -> None:
    raise RocketKVConfigError(
        f"rocketkv.{field_name}={value!r} is invalid: allowed {allowed}"
    )


def _load_preset(name: str) -> dict[str, Any]:
    if os.path.sep in name or name.endswith((".yaml", ".yml")):
        path = name
        if not os.path.isfile(path):
            _fail("preset", name, "a preset name from list_presets() or a YAML file")
        text = open(path, encoding="utf-8").read()
    else:
        files = resources.files("rocketkv_vllm.configs")
        entry = files / f"{name}.yaml"
        if not entry.is_file():
            _fail("preset", name, f"one of {list_presets()} or a path to a YAML file")
        text = entry.read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        _fail("preset", name, "a YAML file holding a mapping of rocketkv settings")
    if "preset" in data:
        _fail("preset", name, "a preset that does not name another preset")
    return data


def list_presets() -> list[str]:
    files = resources.files("rocketkv_vllm.configs")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def parse_config(raw: dict[str, Any] | None) -> RocketKVConfig:
    """Validate the ``rocketkv`` dict of ``additional_config`` (preset first)."""
    raw = dict(raw or {})
    known = {f.name for f in fields(RocketKVConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RocketKVConfigError(
            f"unknown rocketkv setting(s) {unknown}: allowed keys are {sorted(known)}"
        )
    merged: dict[str, Any] = {}
    if raw.get("preset") is not None:
        if not isinstance(raw["preset"], str):
            _fail("preset", raw["preset"], "a string")
        preset = _load_preset(raw["preset"])
        bad = sorted(set(preset) - known)
        if bad:
            _fail("preset", raw["preset"], f"a preset with keys from {sorted(known)}")
        merged.update(preset)
    merged.update(raw)
    # An explicit prompt_budget next to a preset's token_budget means "use mine".
    if "prompt_budget" in raw and "token_budget" not in raw:
        merged["token_budget"] = None
    # token_budget derives these: never ignore one given next to it.
    if merged.get("token_budget") is not None:
        for name in ("prompt_budget", "topk", "topr"):
            if merged.get(name) is not None:
                where = "" if name in raw else f" (set by preset {raw.get('preset')!r})"
                _fail(name, merged[name],
                      "only without token_budget, which derives prompt_budget, "
                      f"topk and topr from one number{where}: give token_budget "
                      "or the explicit knobs, not both")

    for name, (lo, hi) in _INT_RANGES.items():
        value = merged.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(name, value, f"an integer in [{lo}, {hi}]")
        if not lo <= value <= hi:
            _fail(name, value, f"an integer in [{lo}, {hi}]")
    if merged.get("kernel_size") is not None and merged["kernel_size"] % 2 == 0:
        _fail("kernel_size", merged["kernel_size"], "an odd integer in [1, 4095]")
    ps = merged.get("page_size")
    if ps is not None and ps & (ps - 1):
        _fail("page_size", ps, "a power of two in [1, 256] that divides block_size")
    for name in ("force_current_page", "evict", "free_evicted_blocks",
                 "poison_evicted_blocks", "force_graph_layout"):
        if not isinstance(merged.get(name, False), bool):
            _fail(name, merged[name], "true or false")
    if merged.get("kernel", "auto") not in KERNEL_CHOICES:
        _fail("kernel", merged["kernel"], f"one of {list(KERNEL_CHOICES)}")
    if merged.get("kt_dtype", "auto") not in KT_DTYPE_CHOICES:
        _fail("kt_dtype", merged["kt_dtype"], f"one of {list(KT_DTYPE_CHOICES)}")
    for name in ("prompt_budget", "window_size", "kernel_size", "topk",
                 "max_new_tokens", "force_current_page", "evict", "kernel", "kt_dtype",
                 "free_evicted_blocks", "poison_evicted_blocks", "force_graph_layout"):
        if merged.get(name, 0) is None:
            _fail(name, None, "a value (null only for token_budget, page_size, topr)")
    return RocketKVConfig(**merged)


@dataclass(frozen=True)
class RocketKVSettings:
    """Engine-wide resolved settings (config + block size + head dim).

    Frozen and hashable: it travels inside the KV cache spec to the scheduler.
    """

    block_size: int
    head_dim: int
    page_size: int
    window_size: int
    kernel_size: int
    token_budget: int | None
    prompt_budget: int
    topk: int
    topr: int
    max_new_tokens: int
    force_current_page: bool
    kernel: str
    free_evicted_blocks: bool
    poison_evicted_blocks: bool
    evict: bool = True
    kt_dtype: str = "auto"
    force_graph_layout: bool = False

    @property
    def min_prompt_budget(self) -> int:
        # The window and the partly filled tail block always stay, so the
        # budget must cover both for the eviction to be well defined.
        return self.window_size + self.block_size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


def resolve_settings(
    cfg: RocketKVConfig, block_size: int, head_dim: int, max_model_len: int
) -> RocketKVSettings:
    """Bind the user config to the engine; raise on combinations out of range."""
    if cfg.page_size is not None:
        page_size = cfg.page_size
    elif cfg.token_budget is not None:
        # KT pages are laid out inside the KV blocks, so the page size is one
        # per engine: the SPEC split for the longest prompt the engine takes,
        # rounded up to a power of two (at most one block).
        n = max(1, max_model_len - cfg.max_new_tokens)
        page_size = min(block_size, pow2_at_least(split_token_budget(
            cfg.token_budget, n, cfg.max_new_tokens, head_dim).page_size))
    else:
        page_size = min(4, block_size)
    if block_size % page_size:
        _fail("page_size", page_size, f"a power of two that divides block_size={block_size}")
    topr = head_dim if cfg.topr is None else cfg.topr
    if not 1 <= topr <= head_dim:
        _fail("topr", topr, f"an integer in [1, {head_dim}] (the head dim)")
    if cfg.token_budget is None and cfg.topk % page_size:
        # Whole pages are selected: a remainder would be dropped silently.
        _fail("topk", cfg.topk,
              f"a positive multiple of page_size={page_size}")
    if cfg.evict and block_size > cfg.window_size + 1:
        # The prompt's last block stays in place (up to block_size - 1
        # tokens); beyond the window those would be kept without a score,
        # where the reference keeps exactly the window.
        _fail("window_size", cfg.window_size,
              f"an integer in [block_size - 1, 4096] = [{block_size - 1}, 4096] "
              f"with block_size={block_size} (or a smaller KV cache block size)")
    settings = RocketKVSettings(
        block_size=block_size,
        head_dim=head_dim,
        page_size=page_size,
        window_size=cfg.window_size,
        kernel_size=cfg.kernel_size,
        token_budget=cfg.token_budget,
        prompt_budget=cfg.prompt_budget,
        topk=cfg.topk,
        topr=topr,
        max_new_tokens=cfg.max_new_tokens,
        force_current_page=cfg.force_current_page,
        kernel=cfg.kernel,
        free_evicted_blocks=cfg.free_evicted_blocks,
        poison_evicted_blocks=cfg.poison_evicted_blocks,
        evict=cfg.evict,
        kt_dtype=cfg.kt_dtype,
        force_graph_layout=cfg.force_graph_layout,
    )
    if (cfg.evict and cfg.token_budget is None
            and cfg.prompt_budget < settings.min_prompt_budget):
        _fail(
            "prompt_budget",
            cfg.prompt_budget,
            f"an integer >= window_size + block_size = {settings.min_prompt_budget}",
        )
    return settings


@dataclass(frozen=True)
class BudgetSplit:
    prompt_budget: int
    topk: int
    page_size: int
    topr: int


def split_token_budget(
    token_budget: int, num_prompt_tokens: int, max_new_tokens: int, head_dim: int
) -> BudgetSplit:
    """SPEC §1 "budget split from one number", before any kernel rounding."""
    total = num_prompt_tokens + max_new_tokens
    c = max(1.0, total / token_budget)
    alpha = min(0.2 + 0.06 * math.log2(c), 0.8)
    cap = max(int(total / c**alpha), min(2 * max_new_tokens, total))
    c2 = max(1.0, cap / token_budget)
    page_size = math.ceil(math.sqrt(c2))
    if page_size > c2:
        page_size = 1
    topr = min(max(round(head_dim * page_size / c2), 1), head_dim)
    return BudgetSplit(cap - max_new_tokens, token_budget // 2, page_size, topr)


@dataclass(frozen=True)
class RequestPlan:
    """What RocketKV does with one request, derived from its prompt length.

    After compression the request's KV per head is: slots [0, num_compact)
    hold the kept tokens before ``tail_start`` in original order, and the
    block holding the prompt's last tokens stays in place from ``tail_start``
    (block aligned), followed by generated tokens at their logical slots.
    """

    num_prompt_tokens: int
    compress: bool
    prompt_budget: int
    topk: int
    topr: int
    num_compact: int
    tail_start: int

    def freed_block_range(self, block_size: int) -> tuple[int, int]:
        """Logical block indices [start, end) a compressed request gives back."""
        if not self.compress:
            return (0, 0)
        return (-(-self.num_compact // block_size), self.tail_start // block_size)


def plan_request(settings: RocketKVSettings, num_prompt_tokens: int,
                 token_budget: int | None = None) -> RequestPlan:
    """The plan for a prompt of this length; ``token_budget`` is the
    request's own (``request_budget``): None keeps the engine's settings, 0
    serves the request uncompressed, else the SPEC split of that budget at
    the engine's page size."""
    n = num_prompt_tokens
    if token_budget == 0:
        return RequestPlan(n, False, n, settings.topk, settings.topr, 0,
                           (n // settings.block_size) * settings.block_size)
    if token_budget is not None:
        settings = replace(settings, token_budget=token_budget)
    if settings.token_budget is not None:
        split = split_token_budget(
            settings.token_budget, n, settings.max_new_tokens, settings.head_dim
        )
        prompt_budget = max(split.prompt_budget, settings.min_prompt_budget)
        topk = max(split.topk // settings.page_size, 1) * settings.page_size
        # Channel count for the page size actually used, rounded to 16 lanes.
        c2 = max(1.0, (split.prompt_budget + settings.max_new_tokens)
                 / settings.token_budget)
        topr = round(settings.head_dim * settings.page_size / c2 / 16) * 16
        topr = min(max(topr, 16), settings.head_dim)
    else:
        prompt_budget = settings.prompt_budget
        topk = settings.topk
        topr = settings.topr
    tail_start = (n // settings.block_size) * settings.block_size
    if not settings.evict:
        # Stage 2 only: keep all n tokens (identity compaction, nothing
        # freed: num_compact == tail_start); sparse decode pays off only
        # when the prompt exceeds the per-step selection. (The backend still
        # collects the window queries of a compressed prompt, so it must
        # also be longer than the window, as with eviction.)
        compress = n > max(topk, settings.window_size)
        return RequestPlan(n, compress, n, topk, topr,
                           tail_start if compress else 0, tail_start)
    compress = n > prompt_budget
    num_compact = prompt_budget - (n - tail_start) if compress else 0
    return RequestPlan(n, compress, prompt_budget, topk, topr, num_compact, tail_start)


class PlanCache:
    """``plan_request`` for one engine's settings, memoised by (prompt length,
    request budget). Plans are looked up for every row of every step (builder)
    and every scheduled request (block manager); hashing the settings for each
    lookup would cost more than the plan itself."""

    MAX_ENTRIES = 1 << 16

    def __init__(self, settings: RocketKVSettings) -> None:
        self.settings = settings
        self._plans: dict[tuple[int, int | None], RequestPlan] = {}

    def __call__(self, num_prompt_tokens: int,
                 token_budget: int | None = None) -> RequestPlan:
        key = (num_prompt_tokens, token_budget)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.MAX_ENTRIES:
                self._plans.clear()
            plan = self._plans[key] = plan_request(self.settings, *key)
        return plan


def max_topk(settings: RocketKVSettings) -> int:
    """The largest per-step token selection any request of the engine uses."""
    if settings.token_budget is None:
        return settings.topk
    return max(settings.token_budget // 2 // settings.page_size, 1) * settings.page_size


def kept_tokens_per_head(settings: RocketKVSettings, num_prompt_tokens: int) -> int:
    plan = plan_request(settings, num_prompt_tokens)
    return plan.prompt_budget if plan.compress else num_prompt_tokens
