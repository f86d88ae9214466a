"""RocketKV settings: the user's knobs, their validation, presets, and the
settings one engine runs with.

Users pass settings through vLLM's own ``additional_config``::

    vllm serve M --attention-backend ROCKETKV \
        --additional-config '{"rocketkv": {"token_budget": 1024}}'

``RocketKVConfig`` is the one user-facing dataclass: each field's metadata
(``knob``) holds its documentation and allowed values, and drives both the
validation here and the README's configuration table (``config_table``).
Pure Python (no vLLM import): the scheduler-side block manager and the
worker-side backend derive the same plan for a request (``plan``).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from typing import Any

import yaml

from rocketkv_vllm.budget import (
    MAX_VIEW_PAGES,
    kernel_budget,
    max_view_pages,
    pow2_at_least,
    prompt_budget_floor,
)

CONFIG_KEY = "rocketkv"
KERNEL_CHOICES = ("auto", "torch", "triton")
KT_DTYPE_CHOICES = ("auto", "fp8_e4m3")
KEEP_RULE_CHOICES = ("snapkv", "streaming", "h2o")
MAX_INT = 1 << 24


class RocketKVConfigError(ValueError):
    """A RocketKV setting is missing, unknown or out of range."""


def knob(
    default: Any,
    doc: str,
    *,
    kind: type | tuple = int,
    lo: int | None = None,
    hi: int | None = None,
    nullable: bool = False,
    odd: bool = False,
    pow2: bool = False,
    shown: str | None = None,
) -> Any:
    """A user setting: its default, one-line documentation (the README
    table) and what values it allows. ``kind`` is int, bool, str (a preset
    name or path) or a tuple of allowed strings; ``shown`` is the default as
    the table prints it when it is not the value itself."""
    return field(
        default=default,
        metadata=dict(
            doc=doc, kind=kind, lo=lo, hi=hi, nullable=nullable, odd=odd, pow2=pow2, shown=shown
        ),
    )


@dataclass(frozen=True)
class RocketKVConfig:
    """What the user asked for (one preset plus overrides), validated.

    ``token_budget`` switches on the automatic split of SPEC §1; otherwise
    the explicit knobs are used as given. The split derives prompt_budget,
    topk and topr, so an explicit value of those next to token_budget is
    refused (page_size may be given with it: the split is then computed for
    it).
    """

    preset: str | None = knob(
        None,
        "a file from `configs/` (`budget-256`, `budget-1024`, `budget-2048`, "
        "`trtllm`) or a YAML path; keys given next to it override it",
        kind=str,
        nullable=True,
        shown="none",
    )
    token_budget: int | None = knob(
        None,
        "one number B; per request, SPEC §1's split gives `prompt_budget` and "
        "`topk` (see below); `topr` stays the head dim",
        lo=16,
        hi=MAX_INT,
        nullable=True,
        shown="none",
    )
    prompt_budget: int = knob(
        2048,
        "tokens kept per KV head after prefill (prompts this short or shorter "
        "are not compressed); >= `window_size + block_size`",
        lo=2,
        hi=MAX_INT,
    )
    window_size: int = knob(
        32,
        "observation window (last prompt tokens whose queries score the "
        "prompt); always kept; with eviction on, at least `block_size - 1` (the "
        "prompt's last, partly filled block stays in place)",
        lo=1,
        hi=4096,
    )
    kernel_size: int = knob(63, "max-pool width over the scores (odd)", lo=1, hi=4095, odd=True)
    keep_rule: str = knob(
        "snapkv",
        "which prompt tokens Stage 1 keeps (docs/keep-rules.md): `snapkv` (RocketKV's); "
        "baselines `streaming` (4 sinks + the most recent) and `h2o` (accumulated "
        "attention of every prompt query; needs prefix caching off)",
        kind=KEEP_RULE_CHOICES,
    )
    stage1_lead_layer: int = knob(
        0,
        "compressed layers before this layer index keep the prompt positions that the "
        "first compressed layer at or after it chose, per KV head, instead of scoring "
        "their own (0: every layer chooses, the reference); early layers' window "
        "attention misses facts later layers keep (docs/keep-rules.md)",
        lo=0,
        hi=4096,
    )
    page_size: int | None = knob(
        None,
        "tokens per KT page; a power of two dividing the KV block size "
        "(default 4, or derived from `token_budget`)",
        lo=1,
        hi=256,
        nullable=True,
        pow2=True,
        shown="4",
    )
    topk: int = knob(
        256,
        "tokens attended per decode step (`topk / page_size` pages); a multiple "
        "of `page_size`; more than the view means every kept token; refused next "
        "to `token_budget`",
        lo=1,
        hi=MAX_INT,
    )
    topr: int | None = knob(
        None,
        "query channels used to score pages (all of them by default, also "
        "under `token_budget`); refused next to `token_budget`",
        lo=1,
        hi=1024,
        nullable=True,
        shown="head dim",
    )
    max_new_tokens: int = knob(
        256, "generation length the `token_budget` split assumes", lo=1, hi=MAX_INT
    )
    force_current_page: bool = knob(
        True,
        "also attend to the page of the newest token, on top of the `topk` "
        "pages (not in the reference; the `trtllm` preset turns it off)",
        kind=bool,
    )
    evict: bool = knob(
        True,
        "false: Stage 1 evicts nothing and every prompt longer than `topk` "
        "still decodes sparsely (Quest-style)",
        kind=bool,
    )
    kernel: str = knob(
        "auto",
        "`auto`: Triton on NVIDIA, the C++ Stage 2 kernel on CPU; `torch`: "
        "batched PyTorch; `triton`: the Triton kernels (NVIDIA, or "
        "`TRITON_INTERPRET=1`)",
        kind=KERNEL_CHOICES,
    )
    kt_dtype: str = knob(
        "auto",
        "KT pages (per-page min/max keys) in the model dtype (`auto`) or in "
        "fp8 rounded outward (`fp8_e4m3`: about half the bytes; always with an fp8 KV cache)",
        kind=KT_DTYPE_CHOICES,
    )
    reselect_every: int = knob(
        1,
        "decode steps a page selection serves (1: every step selects, the "
        "reference); more reuses it within the newest token's page, which "
        "always reselects when it opens; at most `page_size`",
        lo=1,
        hi=256,
    )
    free_evicted_blocks: bool = knob(
        True, "give evicted blocks back to vLLM (false keeps them: for A/B checks)", kind=bool
    )


# token_budget derives these; an explicit one next to it is refused.
_SPLIT_KNOBS = ("prompt_budget", "topk", "topr")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise RocketKVConfigError(f"rocketkv.{name}={value!r} is invalid: allowed {allowed}")


def _allowed(meta: dict) -> str:
    kind = meta["kind"]
    if kind is bool:
        text = "true or false"
    elif isinstance(kind, tuple):
        text = f"one of {list(kind)}"
    elif kind is str:
        text = "a preset name from list_presets() or a path to a YAML file"
    else:
        text = f"an integer in [{meta['lo']}, {meta['hi']}]"
        if meta["odd"]:
            text = f"an odd integer in [{meta['lo']}, {meta['hi']}]"
        if meta["pow2"]:
            text = f"a power of two in [{meta['lo']}, {meta['hi']}]"
    return text + (" or null" if meta["nullable"] else "")


def _check_value(name: str, value: Any, meta: dict) -> None:
    if value is None:
        if not meta["nullable"]:
            _fail(name, value, _allowed(meta))
        return
    kind = meta["kind"]
    if kind is bool:
        ok = isinstance(value, bool)
    elif isinstance(kind, tuple):
        ok = value in kind
    elif kind is str:
        ok = isinstance(value, str)
    else:
        ok = (
            isinstance(value, int)
            and not isinstance(value, bool)
            and meta["lo"] <= value <= meta["hi"]
            and (not meta["odd"] or value % 2 == 1)
            and (not meta["pow2"] or value & (value - 1) == 0)
        )
    if not ok:
        _fail(name, value, _allowed(meta))


_KNOBS = {f.name: f.metadata for f in fields(RocketKVConfig)}


def _read_preset_file(name: str, text_of) -> dict[str, Any]:
    """The mapping in a preset file; errors name ``rocketkv.preset`` and the
    reason, never the file's content."""
    try:
        text = text_of()
    except UnicodeDecodeError:
        _fail("preset", name, "a UTF-8 YAML text file (this one is binary)")
    except OSError as e:
        _fail("preset", name, f"a readable YAML file ({e.strerror})")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        # The parser's own message quotes the file: say only what is wrong.
        what = (
            "uses a YAML tag" if isinstance(e, yaml.constructor.ConstructorError) else "is not YAML"
        )
        _fail("preset", name, f"a plain YAML mapping without tags (this file {what}{where})")
    if data is None:
        return {}
    if not isinstance(data, dict):
        _fail("preset", name, "a YAML file holding a mapping of rocketkv settings")
    return data


def _load_preset(name: str) -> dict[str, Any]:
    if os.path.sep in name or name.endswith((".yaml", ".yml")):
        if not os.path.isfile(name):
            _fail("preset", name, "a preset name from list_presets() or a YAML file")

        def text_of():
            with open(name, encoding="utf-8") as f:
                return f.read()
    else:
        entry = resources.files("rocketkv_vllm.configs") / f"{name}.yaml"
        if not entry.is_file():
            _fail("preset", name, f"one of {list_presets()} or a path to a YAML file")

        def text_of():
            return entry.read_text(encoding="utf-8")

    data = _read_preset_file(name, text_of)
    bad = sorted(str(k) for k in set(data) - set(_KNOBS))
    if bad:
        _fail("preset", name, f"a preset with keys from {sorted(_KNOBS)} (not {bad})")
    if "preset" in data:
        _fail("preset", name, "a preset that does not name another preset")
    return data


def list_presets() -> list[str]:
    files = resources.files("rocketkv_vllm.configs")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def parse_config(raw: dict[str, Any] | None) -> RocketKVConfig:
    """Validate the ``rocketkv`` dict of ``additional_config`` (preset first)."""
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(_KNOBS), key=str)
    if unknown:
        raise RocketKVConfigError(
            f"unknown rocketkv setting(s) {unknown}: allowed keys are {sorted(_KNOBS)}"
        )
    merged: dict[str, Any] = {}
    if raw.get("preset") is not None:
        _check_value("preset", raw["preset"], _KNOBS["preset"])
        merged.update(_load_preset(raw["preset"]))
    merged.update(raw)
    # An explicit prompt_budget next to a preset's token_budget means "use mine".
    if "prompt_budget" in raw and "token_budget" not in raw:
        merged["token_budget"] = None
    for name, value in merged.items():
        _check_value(name, value, _KNOBS[name])
    if merged.get("token_budget") is not None:
        for name in _SPLIT_KNOBS:
            if merged.get(name) is not None:
                where = "" if name in raw else f" (set by preset {raw.get('preset')!r})"
                _fail(
                    name,
                    merged[name],
                    "only without token_budget, which derives prompt_budget, "
                    f"topk and topr from one number{where}: give token_budget "
                    "or the explicit knobs, not both",
                )
    return RocketKVConfig(**merged)


def config_table() -> str:
    """The README's configuration table, from the knobs' metadata."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in fields(RocketKVConfig):
        meta = f.metadata
        default = meta["shown"] or (
            str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
        )
        rows.append(f"| `{f.name}` | {default} | {meta['doc']} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class RocketKVSettings(RocketKVConfig):
    """What one engine runs with: the user's config bound to the engine's
    block size and head dim, with ``page_size`` and ``topr`` resolved.

    Frozen and hashable: it travels inside the KV cache spec to the
    scheduler. Per-request values (prompt budget, top-k, top-r of a request)
    come from its plan (``plan.plan_request``), not from here.
    """

    block_size: int = 16
    head_dim: int = 64

    @property
    def min_prompt_budget(self) -> int:
        return prompt_budget_floor(self.window_size, self.block_size)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_settings(
    cfg: RocketKVConfig, block_size: int, head_dim: int, max_model_len: int
) -> RocketKVSettings:
    """Bind the user config to the engine; raise on combinations out of range."""
    topr = head_dim if cfg.topr is None else cfg.topr
    # One page size per engine (KT pages sit inside the KV blocks): the
    # budget split's for the longest prompt the engine takes.
    longest = max(1, max_model_len - cfg.max_new_tokens)
    page_size = kernel_budget(
        replace(cfg, topr=topr), longest, head_dim=head_dim, block_size=block_size
    ).page_size
    if block_size % page_size:
        _fail("page_size", page_size, f"a power of two that divides block_size={block_size}")
    if max_view_pages(max_model_len, page_size) > MAX_VIEW_PAGES:
        least = pow2_at_least(max_model_len / (MAX_VIEW_PAGES - 1))
        _fail(
            "page_size",
            page_size,
            f"a power of two in [{least}, {block_size}] with max_model_len={max_model_len} "
            f"(at most {MAX_VIEW_PAGES} pages a request)",
        )
    if not 1 <= topr <= head_dim:
        _fail("topr", topr, f"an integer in [1, {head_dim}] (the head dim)")
    if cfg.token_budget is None and cfg.topk % page_size:
        # Whole pages are selected: a remainder would be dropped silently.
        _fail("topk", cfg.topk, f"a positive multiple of page_size={page_size}")
    if cfg.evict and block_size > cfg.window_size + 1:
        # The prompt's last block stays in place (up to block_size - 1
        # tokens); beyond the window those would be kept without a score,
        # where the reference keeps exactly the window.
        _fail(
            "window_size",
            cfg.window_size,
            f"an integer in [block_size - 1, 4096] = [{block_size - 1}, 4096] "
            f"with block_size={block_size} (or a smaller KV cache block size)",
        )
    if cfg.reselect_every > page_size:
        # A selection lives within one page of the newest token: past
        # page_size steps it is reselected anyway.
        _fail(
            "reselect_every",
            cfg.reselect_every,
            f"an integer in [1, page_size] = [1, {page_size}]",
        )
    settings = RocketKVSettings(
        **{**asdict(cfg), "page_size": page_size, "topr": topr},
        block_size=block_size,
        head_dim=head_dim,
    )
    if cfg.evict and cfg.token_budget is None and cfg.prompt_budget < settings.min_prompt_budget:
        _fail(
            "prompt_budget",
            cfg.prompt_budget,
            f"an integer >= window_size + block_size = {settings.min_prompt_budget}",
        )
    return settings


@dataclass(frozen=True)
class TestAids:
    """Test-only switches, from ``additional_config["rocketkv_testing"]``
    (not user settings; not in the README table)."""

    # Overwrite what a compressed request gives back before the scheduler
    # reuses it, so a later read of it changes the output.
    poison_evicted_blocks: bool = False
    # Lay decode steps out as a FULL CUDA graph replays them (backend.graphs),
    # also where vLLM captures none (CPU).
    force_graph_layout: bool = False
    # Keep every Stage 1's kept positions in the worker state (state.kept_positions).
    record_kept_positions: bool = False


TEST_AIDS_KEY = "rocketkv_testing"


def parse_test_aids(raw: dict[str, Any] | None) -> TestAids:
    raw = dict(raw or {})
    allowed = {f.name for f in fields(TestAids)}
    for name, value in raw.items():
        if name not in allowed or not isinstance(value, bool):
            raise RocketKVConfigError(
                f"{TEST_AIDS_KEY}.{name}={value!r} is invalid: allowed keys "
                f"{sorted(allowed)}, each true or false"
            )
    return TestAids(**raw)


# Settings of an engine, read from its VllmConfig (duck-typed: no vLLM import).


def _normalized(key: str) -> str:
    return key.lower().replace("_", "").replace("-", "")


def _extra(vllm_config) -> dict:
    extra = vllm_config.additional_config or {}
    return extra if isinstance(extra, dict) else {}


def raw_config(vllm_config) -> dict:
    """``additional_config["rocketkv"]``; a near miss of the key (``rocketKV``,
    ``rocket_kv``) is an error, not silently the default settings."""
    extra = _extra(vllm_config)
    for key in extra:
        if key != CONFIG_KEY and _normalized(str(key)) == CONFIG_KEY:
            raise RocketKVConfigError(
                f"additional_config key {key!r} is not a ROCKETKV key: did you mean {CONFIG_KEY!r}?"
            )
    raw = extra.get(CONFIG_KEY)
    if raw is not None and not isinstance(raw, dict):
        raise RocketKVConfigError(
            f"additional_config.{CONFIG_KEY} must be a JSON object, got {raw!r}"
        )
    return raw or {}


@functools.lru_cache(maxsize=64)
def _settings(
    raw_json: str, block_size: int, head_dim: int, max_model_len: int
) -> RocketKVSettings:
    return resolve_settings(
        parse_config(json.loads(raw_json)),
        block_size=block_size,
        head_dim=head_dim,
        max_model_len=max_model_len,
    )


def _settings_key(raw: dict) -> str:
    """``raw`` as JSON text (the settings cache's key). Settings are JSON
    scalars: anything else (a set, bytes, a tuple, an object given to
    ``LLM(additional_config=...)``) gets the error that names its field and
    the allowed values, not json's TypeError."""
    scalar = (str, int, float, type(None))
    if not all(isinstance(k, str) and isinstance(v, scalar) for k, v in raw.items()):
        parse_config(raw)  # raises for the first such setting
    return json.dumps(raw, sort_keys=True)


def settings_for(vllm_config) -> RocketKVSettings:
    """The ROCKETKV settings of the engine this config describes."""
    model_config = vllm_config.model_config
    return _settings(
        _settings_key(raw_config(vllm_config)),
        vllm_config.cache_config.block_size,
        model_config.get_head_size(),
        model_config.max_model_len,
    )


def test_aids_for(vllm_config) -> TestAids:
    return parse_test_aids(_extra(vllm_config).get(TEST_AIDS_KEY))
