"""How much true attention a page selection keeps, on a real prompt.

Runs the model in transformers (no vLLM), takes every layer's post-RoPE
queries and keys for a RULER-style prompt plus the model's own greedy
continuation, and for each decode position, page size and top-k reports:
the attention mass the selected pages hold (worst query head, mean over
layers) and in how many layers the page being written (the newest tokens)
is selected. Selection is ``algorithm.hsa_select_pages`` over all channels,
no forced page: the ``quest`` method of ``rocketkv_eval.accuracy`` before it kept
the current page.

    python scripts/page_recall.py --task niah_single --length 2048
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--page-sizes", default="4,8,16")
    ap.add_argument("--topks", default="256,1024")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from rocketkv_eval import tasks as eval_tasks
    from rocketkv_eval.model import prepare_default_model
    from rocketkv_vllm.algorithm.hsa import hsa_select_pages

    path = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sample = eval_tasks.make_samples(args.task, tokenizer, args.length, 1)[0]
    ids = torch.tensor([sample.token_ids])
    prompt_len = ids.shape[1]
    with torch.no_grad():
        ids = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    print("continuation:", repr(tokenizer.decode(ids[0, prompt_len:])))

    inputs = {}

    def keep_inputs(i):
        def hook(module, a, kw):
            inputs[i] = (kw["hidden_states"], kw["position_embeddings"])

        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(keep_inputs(i), with_kwargs=True)
    with torch.no_grad():
        model(ids)

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    n = ids.shape[1]
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    topks = [int(x) for x in args.topks.split(",")]
    recall: dict[tuple, list[float]] = {}
    current: dict[tuple, int] = {}
    for i, layer in enumerate(model.model.layers):
        hidden, (cos, sin) = inputs[i]
        attn = layer.self_attn
        with torch.no_grad():
            q = attn.q_proj(hidden).view(1, n, hq, d).transpose(1, 2)
            k = attn.k_proj(hidden).view(1, n, hkv, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        for pos in range(prompt_len - 1, n):
            query, keys = q[0, :, pos], k[0, :, : pos + 1].transpose(0, 1)
            seen = pos + 1
            probs = (
                torch.einsum("kgd,tkd->kgt", query.view(hkv, hq // hkv, d), keys) * d**-0.5
            ).softmax(-1)
            for ps in page_sizes:
                pages = -(-seen // ps)
                padded = torch.nn.functional.pad(
                    keys, (0, 0, 0, 0, 0, pages * ps - seen), value=float("nan")
                )
                padded = padded.view(pages, ps, hkv, d)
                kmin = torch.where(padded.isnan(), torch.inf, padded).amin(1)
                kmax = torch.where(padded.isnan(), -torch.inf, padded).amax(1)
                tokens = torch.full((pages,), ps)
                tokens[-1] = seen - (pages - 1) * ps
                for topk in topks:
                    selected = hsa_select_pages(
                        query,
                        kmin,
                        kmax,
                        torch.ones(pages, dtype=torch.bool),
                        d,
                        max(topk // ps, 1),
                        None,
                        tokens,
                    )
                    mask = selected.repeat_interleave(ps, 1)[:, :seen]
                    held = (probs * mask[:, None, :]).sum(-1).min().item()
                    key = (ps, topk, pos - prompt_len + 1)
                    recall.setdefault(key, []).append(held)
                    current[key] = current.get(key, 0) + int(selected[:, -1].all())
    layers = len(model.model.layers)
    print(
        f"{'page':>4} {'topk':>5} {'step':>4} {'recall min':>10} {'mean':>6} "
        f"{'current page chosen':>20}"
    )
    for key in sorted(recall):
        vals = recall[key]
        print(
            f"{key[0]:4d} {key[1]:5d} {key[2]:4d} {min(vals):10.3f} "
            f"{sum(vals) / len(vals):6.3f} {current[key]:>13d} of {layers}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
