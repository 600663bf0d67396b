"""A Hugging Face experts module on one GPU: HF's own ``grouped_mm`` forward against the one
``simple_fsdp`` runs at ``ep=1`` (:mod:`simplefsdp.moe.hf_experts`: the same sort and grouped
matmuls, without the sentinel masks and the inverse permutation).

At the shapes of ``configs/gpu_hf_moe.toml`` (global batch x seq_len tokens, bf16 weights as the
gathers give them, routing weights from a softmax top-k of random logits), it compares the output
and every gradient with those of HF's first call, eager and compiled (HF's own later call shows what
varies from call to call: Inductor's scatter-add into the input gradient uses atomics), and times
forward + backward of each (CUDA events, median of ``--repeats`` runs of ``--iters`` calls queued
back to back). The experts alone: no router, attention or communication; the whole step is
``step_time.py --models hf_moe``.

    python benchmarks/hf_experts.py [--out benchmarks/results/hf_experts_h100.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from simplefsdp.models.hf import hf_causal_lm
from simplefsdp.moe.hf_experts import is_hf_experts, make_expert_parallel
from simplefsdp.train.config import load

from optimizer_step import median_ms
from report import command_line, environment, output_arguments, publish, table


def experts_and_inputs(config: str, device: str):
    cfg = load(config)
    model_cfg = cfg.model_config()
    model_cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_causal_lm(model_cfg)
    hf = next(m for m in model.modules() if is_hf_experts(m)).to(torch.bfloat16)
    tokens = cfg.training.global_batch * cfg.training.seq_len
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(tokens, model_cfg.hidden_size, device=device, generator=g, dtype=torch.bfloat16)
    logits = torch.randn(tokens, hf.num_experts, device=device, generator=g)
    weights, index = torch.softmax(logits, -1).topk(model_cfg.num_experts_per_tok, -1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    return hf, (hidden, index, weights)


def step(module, inputs, grad_out) -> dict[str, torch.Tensor]:
    """Output and gradients (input, routing weights, every parameter) of one forward + backward."""
    hidden, index, weights = inputs
    hidden, weights = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    for p in module.parameters():
        p.grad = None
    out = module(hidden, index, weights)
    out.backward(grad_out)
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in module.named_parameters()}
    return {"output": out, "input grad": hidden.grad, "routing weights grad": weights.grad, **grads}


def unequal(a: dict, b: dict) -> str:
    """The tensors that differ between two steps, with the largest difference of each."""
    return ", ".join(f"{k} ({(a[k].float() - b[k].float()).abs().max():.2g})" for k in a if not torch.equal(a[k], b[k])) or "none"


def measure(config: str, iters: int, repeats: int) -> list[dict]:
    hf, inputs = experts_and_inputs(config, "cuda")
    ours = copy.deepcopy(hf)
    make_expert_parallel(ours, None)
    grad_out = torch.randn_like(inputs[0])
    rows = []
    for how, wrap in (("eager", lambda m: m), ("compiled", torch.compile)):
        runs = {"HF grouped_mm": wrap(hf), "simple_fsdp ep=1": wrap(ours)}
        first = step(runs["HF grouped_mm"], inputs, grad_out)
        for name, m in runs.items():
            # against HF's first call: HF's own second call shows what varies between calls
            rows.append(dict(run=name, mode=how, ms=median_ms(lambda: step(m, inputs, grad_out), 1, iters, repeats),
                             unequal=unequal(first, step(m, inputs, grad_out))))
    return rows


def markdown(result: dict) -> str:
    return (f"**{result['environment']}**: `{result['command']}`; shapes of `{result['config']}`.\n\n"
            + table(["experts forward", "mode", "fwd+bwd ms", "tensors unequal to HF's first call (max diff)"],
                    [[r["run"], r["mode"], r["ms"], r["unequal"]] for r in result["rows"]]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpu_hf_moe.toml")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    output_arguments(p)
    args = p.parse_args()
    if args.report:
        return publish("hf_experts", "Hugging Face experts on one GPU", markdown, json.load(open(args.report)), args)
    result = dict(environment=environment(torch.cuda.get_device_name()), command=command_line(),
                  config=args.config, rows=measure(args.config, args.iters, args.repeats))
    publish("hf_experts", "Hugging Face experts on one GPU", markdown, result, args)


if __name__ == "__main__":
    main()
