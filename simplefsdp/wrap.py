"""``simple_fsdp()``: validate, plan, then turn every parameter into a sharded DTensor.

1. **Validate** everything on every rank before anything changes or communicates: the model, the
   mesh and mode (:mod:`.mesh_layout`), tensor-parallel parameters, shapes, dtypes, routed experts.
2. **Plan** per parameter how compute gathers it (a :class:`~simplefsdp.param_gather.ParamGather`)
   and how it is stored (a function of :mod:`.sharding`).
3. **Apply**: module by module, initialize meta parameters (``reset_parameters()``, or a Hugging
   Face model's ``_init_weights``) and store each parameter as its shard (tied parameters once),
   attach the token dispatcher to routed experts, and swap each parameter-owning module's class
   for one whose parameters read as shards outside forward and gathered inside
   (:mod:`.param_access`); install the root's hooks (mixed-precision casts, eager resharding).
"""

from __future__ import annotations

import collections
import contextlib
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only

from simplefsdp import compile_cache, passes, sharding
from simplefsdp.eager_reshard import resharding_saved_tensors
from simplefsdp.hf_generate import sync_generate
from simplefsdp.mesh_layout import DataParallelLayout, resolve_layout
from simplefsdp.moe.routed_experts import is_routed_experts, set_dispatcher, unrecognised_experts
from simplefsdp.moe.token_dispatch import DEFAULT_EP_CHUNKS, TokenDispatcher, token_group
from simplefsdp.param_access import ForwardState, WrappedParams, attach, count_forwards, is_wrapped
from simplefsdp.param_gather import ParamGather, param_gather, quiet_context_fn_notice

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_simple_fsdp(model: nn.Module) -> bool:
    """Whether ``simple_fsdp`` has wrapped ``model`` or any of its submodules."""
    return any(is_wrapped(m) for m in model.modules())


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module; got {type(model).__name__}")
    for name, module in model.named_modules():
        if is_wrapped(module):
            raise ValueError(f"module {name or '<root>'!r} is already wrapped by simple_fsdp")
        if isinstance(module, FSDPModule):
            raise ValueError(f"module {name or '<root>'!r} is already wrapped by fully_shard")


def _check_tp_parameters(model: nn.Module, layout: DataParallelLayout) -> None:
    """DTensor parameters must come from tensor parallelism on the mesh's ``tp`` dim, split evenly."""
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        if layout.tp_mesh is None:
            raise ValueError(
                f"parameter {name!r} is already a DTensor; without a 'tp' mesh dim simple_fsdp "
                "shards plain parameters only"
            )
        if param.device_mesh != layout.tp_mesh:
            raise ValueError(
                f"parameter {name!r} is a DTensor on {param.device_mesh}, not on the mesh's 'tp' dim"
            )
        tp = layout.tp_mesh.size()
        for placement in param.placements:
            if isinstance(placement, Shard) and param.shape[placement.dim] % tp:
                raise ValueError(
                    f"parameter {name!r}: tp={tp} does not divide dim {placement.dim} of shape "
                    f"{tuple(param.shape)}; tensor-parallel compute needs even splits"
                )


def _check_parameters(model: nn.Module, layout: DataParallelLayout) -> None:
    """Shapes simple_fsdp cannot store, and meta parameters it cannot initialize."""
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if param.ndim == 0 and any(isinstance(p, Shard) for p in layout.shard):
                raise ValueError(
                    f"parameter {full!r} is 0-dim and {layout.mode} shards dim 0; store it with shape [1]"
                )
            if param.is_meta and _initializer(model, module) is None:
                raise ValueError(
                    f"parameter {full!r} is on the meta device and {type(module).__name__} has no "
                    "reset_parameters() to initialize it; materialize the model or define reset_parameters()"
                )


def _check_mp_policy(mp_policy: MixedPrecisionPolicy | None) -> MixedPrecisionPolicy:
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy; got {type(mp_policy).__name__}"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and dtype not in _COMPUTE_DTYPES:
            raise ValueError(
                f"mp_policy.{field} must be one of {_COMPUTE_DTYPES} (float8 needs scaled matmuls, "
                f"not a cast); got {dtype!r}"
            )
    return mp_policy


def _check_flags(ep, ep_chunks, reshard_after_forward) -> int:
    """Check the flags; returns the number of token chunks per MoE layer."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep must be a positive int; got {ep!r}")
    if ep_chunks is not None:
        if not isinstance(ep_chunks, int) or isinstance(ep_chunks, bool) or ep_chunks < 1:
            raise ValueError(f"ep_chunks must be a positive int (1: no chunking); got {ep_chunks!r}")
        if ep == 1 and ep_chunks > 1:
            raise ValueError(f"ep_chunks={ep_chunks} needs ep > 1: without expert parallelism there is no all-to-all to overlap")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            "reshard_after_forward must be True or False (FSDP2's int form, resharding to a "
            f"smaller group, is not supported); got {reshard_after_forward!r}"
        )
    return 1 if ep == 1 else ep_chunks or DEFAULT_EP_CHUNKS


def _is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _initializer(model: nn.Module, module: nn.Module):
    """How ``module``'s tensors are initialized once allocated: a Hugging Face model's own
    ``_init_weights(module)`` (what ``from_config`` runs on every module), else the module's
    ``reset_parameters()``; None when it has neither."""
    if _is_hf_model(model):
        return lambda: model._init_weights(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def _materialize(model: nn.Module, module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s own meta parameters and buffers on ``device`` and initialize them."""
    tensors = {**module._parameters, **module._buffers}
    if not any(t is not None and t.is_meta for t in tensors.values()):
        return
    module.to_empty(device=device, recurse=False)
    init = _initializer(model, module)
    if init is not None:  # a module of meta buffers only may have none
        with torch.no_grad():
            init()


def _mesh_device(layout: DataParallelLayout) -> torch.device:
    device_type = layout.dp_mesh.device_type
    if device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, device_type)
    return torch.device(device_type, handle.current_device())


# a router's own parameter (``gate``, ``router``, ``gate_weight``, ``router_bias`` ...; not the
# experts' ``gate_up_proj`` or ``gate_proj``): it scores every token, so it cannot be split by expert
_ROUTER_NAME = re.compile(r"(^|_)(gate|router)(_weight|_bias)?$")


def _routed_experts(model: nn.Module, layout: DataParallelLayout, ep: int) -> dict[nn.Module, int]:
    """The routed-expert modules to shard over ep, with their FSDP dim (ValueError if unfit).

    Every check runs before the expert mesh is first read (``layout.experts`` creates its groups).
    """
    if ep == 1:
        return {}
    found = []
    for name, module in model.named_modules():
        if not is_routed_experts(module):
            continue
        if module.num_experts % ep:
            raise ValueError(f"{name}: num_experts={module.num_experts} is not divisible by ep={ep}")
        for pname, param in module.named_parameters(recurse=False):
            if _ROUTER_NAME.search(pname):
                raise ValueError(
                    f"{name}.{pname}: a router parameter inside the routed-experts module would be split "
                    "over ep by expert; make the router a sibling module (as Hugging Face models do), "
                    "or a submodule, whose parameters stay on the dense mesh"
                )
            if param.shape[0] != module.num_experts:
                raise ValueError(
                    f"{name}.{pname}: routed-expert parameters stack experts in dim 0 "
                    f"(expected {module.num_experts}, got shape {tuple(param.shape)})"
                )
        found.append(module)
    if not found:
        unrecognised = unrecognised_experts(model)
        raise ValueError(
            f"ep={ep} but the model has no routed experts (modules with `num_experts` and an "
            "`expert_parallel` attribute, or Hugging Face experts decorated with `@use_experts_implementation`)"
            + (f"; these experts follow neither contract: {', '.join(unrecognised[:3])}" if unrecognised else "")
        )
    return {module: layout.experts.fsdp_dim(module.num_experts) for module in found}


@dataclass(frozen=True)
class _GatherSettings:
    """What every parameter's gather shares: the mixed-precision dtypes and resharding."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool

    def gather(self, steps, **kwargs) -> ParamGather:
        return param_gather(steps, self.param_dtype, self.reduce_dtype, self.reshard_after_forward, **kwargs)


def _tp_gather(param: DTensor, layout: DataParallelLayout, settings: _GatherSettings) -> ParamGather:
    """Gather over the dp dims only and hand compute a DTensor on the tp mesh."""
    tp_placement = param.placements[0]
    kept = ((tp_placement.dim, layout.tp_mesh.size()),) if isinstance(tp_placement, Shard) else ()
    return settings.gather(layout.gather_steps, kept_split=kept, tp=(layout.tp_mesh, param.placements))


def _plan_parameter(param, expert_fsdp_dim: int | None, layout: DataParallelLayout, settings: _GatherSettings, device):
    """How ``param`` is gathered for compute, and how it is sharded for storage."""
    if expert_fsdp_dim is not None:
        experts = layout.experts
        gather = settings.gather(
            layout.experts_gather_steps(expert_fsdp_dim),
            kept_split=((0, experts.ep),),
            reduce_op="sum",
            grad_divisor=float(layout.dp_degree),
        )
        return gather, sharding.ExpertSharding(experts, expert_fsdp_dim, device)
    if isinstance(param, DTensor):
        return _tp_gather(param, layout, settings), sharding.TensorParallelSharding(layout, param.placements[0])
    return settings.gather(layout.gather_steps), sharding.DenseSharding(layout, device)


def _cast(dtype: torch.dtype, tree):
    """``tree`` with every floating-point tensor cast to ``dtype``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


class _RootHooks:
    """The root's forward hooks: cast inputs and outputs as ``mp_policy`` asks; pack saved tensors
    for eager resharding. An object of a module-level class, so ``torch.save(model)`` pickles it."""

    def __init__(self, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool):
        self.input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self.output_dtype = mp_policy.output_dtype
        self.reshard_after_forward = reshard_after_forward
        self.open = contextlib.ExitStack()

    def pre(self, module, args, kwargs):
        if self.reshard_after_forward and not torch.compiler.is_compiling():
            self.open.enter_context(resharding_saved_tensors())
        return None if self.input_dtype is None else _cast(self.input_dtype, (args, kwargs))

    def post(self, module, args, kwargs, output):
        self.open.close()
        return None if self.output_dtype is None else _cast(self.output_dtype, output)


def _install_root_hooks(
    model: nn.Module, state: ForwardState, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool
) -> None:
    """Count the root's forward (parameters read gathered inside it), then :class:`_RootHooks`."""
    count_forwards(model, state, root=True)
    hooks = _RootHooks(mp_policy, reshard_after_forward)
    model.register_forward_pre_hook(hooks.pre, with_kwargs=True)
    model.register_forward_hook(hooks.post, with_kwargs=True, always_call=True)


def simple_fsdp(
    model: nn.Module,
    mesh,
    *,
    mode: str | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    ep: int = 1,
    ep_chunks: int | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters over the data-parallel dims of ``mesh`` (in place; returns ``model``).

    Args:
        model: the module to wrap; its parameters must be plain tensors (on the mesh's device, the
            CPU, or the meta device when their modules define ``reset_parameters()`` or the model
            is a Hugging Face ``PreTrainedModel``; each module is then allocated, initialized and
            sharded in turn, so no rank holds the whole model).
        mesh: a 1-D DeviceMesh (fully sharded over it) or a mesh with dims named ``dp_replicate``,
            ``dp_shard`` and ``tp``.
        mode: ``"fully_shard"`` (Shard(0) on ``dp_shard``), ``"replicate"`` (DDP: Replicate on
            ``dp_replicate``) or ``"hybrid_shard"`` (both); inferred from the mesh dims when None.
        mp_policy: FSDP2's ``MixedPrecisionPolicy``: gather in ``param_dtype``, reduce gradients in
            ``reduce_dtype`` (default ``param_dtype``), keep the sharded parameters in their dtype.
        reshard_after_forward: free gathered parameters after forward and gather again in backward.
        ep: expert-parallel degree. With ``ep > 1`` the ``dp_shard`` dim is split into
            ``edp x ep``: routed experts (modules with ``num_experts`` and ``expert_parallel``)
            are sharded over ``ep`` by expert and FSDP-sharded over ``edp``; tokens reach them by
            all-to-all. Sets ``torch._dynamo.config.capture_scalar_outputs`` so the all-to-all
            split sizes trace without a graph break.
        ep_chunks: with ``ep > 1``, how many token chunks each MoE layer splits its tokens into
            (default 2), so that one chunk's routed experts run while another chunk's tokens
            travel (:mod:`simplefsdp.moe.token_dispatch`); 1: no chunking. Chunking changes the
            order in which the expert weights' gradients are summed, not any token's result.
            The token all-to-alls get a process group of their own over the ep ranks.

    Installs SimpleFSDP's Inductor passes (``simplefsdp.passes.install``) so that a later
    ``torch.compile`` runs them on this model's graphs; ``simplefsdp.compile_options`` configures
    them per compile.
    Gradients are averaged over the data-parallel ranks, as with ``fully_shard``.
    """
    # validate: every check runs on every rank before anything is changed or communicated
    _check_model(model)
    chunks = _check_flags(ep, ep_chunks, reshard_after_forward)
    layout = resolve_layout(mesh, mode, ep)
    _check_tp_parameters(model, layout)
    _check_parameters(model, layout)
    mp_policy = _check_mp_policy(mp_policy)
    routed = _routed_experts(model, layout, ep)
    device = _mesh_device(layout)

    # plan: how each parameter is gathered and stored (tied parameters once)
    settings = _GatherSettings(mp_policy.param_dtype, mp_policy.reduce_dtype, reshard_after_forward)
    plans = []
    for module in model.modules():
        names = tuple(n for n, p in module._parameters.items() if p is not None)
        if names:
            plan = {n: _plan_parameter(module._parameters[n], routed.get(module), layout, settings, device) for n in names}
            plans.append((module, names, plan))

    # apply: modules are materialized (meta parameters allocated and initialized) and sharded one
    # at a time, in registration order: peak memory is one module's full parameters, and a seeded
    # run draws the same values as building the model on the device
    tokens = token_group(layout.experts.ep_mesh, layout.ep_rank_groups()) if routed else None
    state = ForwardState()
    # tied parameters (one object under several owners) are sharded once and share one key
    owners = collections.Counter(id(module._parameters[n]) for module, names, _ in plans for n in names)
    keys = {pid: i for i, pid in enumerate(owners)}
    sharded: dict[int, nn.Parameter] = {}
    for module, names, plan in plans:
        if module in routed:
            experts = layout.experts
            set_dispatcher(
                module, TokenDispatcher(experts.ep_mesh, module.num_experts, experts.tp_mesh, chunks=chunks, group=tokens)
            )
        elif is_routed_experts(module):  # ep 1: HF experts run HF's grouped_mm without its sort (hf_experts)
            set_dispatcher(module, None)
        wrapped = WrappedParams(
            gathers={n: plan[n][0] for n in names},
            shardings={n: plan[n][1] for n in names},
            keys={n: keys[id(module._parameters[n])] for n in names},
            tied={n: owners[id(module._parameters[n])] > 1 for n in names},
        )
        originals = {name: module._parameters[name] for name in names}  # tied: one object, before allocation
        _materialize(model, module, device)  # before its parameters become shards
        for name in names:
            pid = id(originals[name])
            if pid not in sharded:
                sharded[pid] = plan[name][1].store(module._parameters[name])
            module._parameters[name] = sharded[pid]
        attach(module, wrapped, state)
        for name in names:
            if wrapped.tied[name]:
                state.tied.setdefault(wrapped.keys[name], (module, name))
    if routed:  # dispatch split sizes become unbacked symbolic sizes, not graph breaks
        torch._dynamo.config.capture_scalar_outputs = True
    if reshard_after_forward:
        quiet_context_fn_notice()
    for module in model.modules():  # buffers follow the parameters to the mesh's device
        if not any(p is not None for p in module._parameters.values()):
            _materialize(model, module, device)  # a module of meta buffers only
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    _install_root_hooks(model, state, mp_policy, reshard_after_forward)
    if _is_hf_model(model):  # generate() keeps every rank stepping until all ranks' sequences end
        sync_generate(model)
    compile_cache.install()
    passes.install(layout.group_names() | ({tokens.group_name} if tokens is not None else set()))
    return model
