"""The training job's configuration: TOML files under ``configs/`` plus ``--section.key value``
overrides on the command line, checked before any rank starts.

A config has five sections; every key has a default, so a file names only what it changes::

    [model]       kind = "dense" | "moe", then the fields of TransformerConfig / MoEConfig; or
                  kind = "hf", model_type (a transformers model type) or config (a local
                  config.json), optional experts_implementation and attn_implementation, then
                  that config's fields
    [parallel]    dp_replicate, dp_shard (-1: the ranks left over), tp, ep, ep_chunks, mode,
                  reshard_after_forward, activation_checkpoint
    [training]    steps, lr, seed, global_batch, seq_len, dataset, compile, passes, blocks_once,
                  precompile, param_dtype, reduce_dtype, max_norm, norm_in_backward, cpu_simd, baseline
    [checkpoint]  folder, interval, resume
    [metrics]     out_dir, tensorboard, peak_tflops

Any bad value raises :class:`ConfigError`, one line that names the key (``parallel.ep: ...``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field

from simplefsdp.models.llama import TransformerConfig
from simplefsdp.models.moe import MoEConfig


class ConfigError(ValueError):
    """A bad config key or value; the message names the key."""


MODEL_KINDS = {"dense": TransformerConfig, "moe": MoEConfig}
HF = "hf"  # a Hugging Face transformers model: its fields are the transformers config's
# [model] keys besides config fields; weights: a local save_pretrained directory to start from
HF_KEYS = ("model_type", "config", "experts_implementation", "attn_implementation", "weights")
DTYPES = ("float32", "bfloat16")
# simplefsdp, or the same job on torch's fully_shard, or on transformers' own expert parallelism
BASELINES = ("simplefsdp", "fsdp2", "hf")


@dataclass
class Parallel:
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1
    ep_chunks: int = 0  # token chunks per MoE layer with ep > 1 (simple_fsdp's ep_chunks); 0: its default
    mode: str = "auto"  # or fully_shard | replicate | hybrid_shard (simple_fsdp's modes)
    reshard_after_forward: bool = True
    activation_checkpoint: str = "none"  # none | full | selective


@dataclass
class Training:
    steps: int = 20
    lr: float = 1e-2
    seed: int = 0
    global_batch: int = 8  # sequences per step over all data-parallel ranks
    seq_len: int = 32
    dataset: str = "synthetic"  # or a .txt (bytes as tokens) / .bin (uint16) / .pt token file
    compile: bool = True
    passes: bool = True  # SimpleFSDP's Inductor passes (when compiled)
    blocks_once: bool = False  # compile each distinct block once (simplefsdp.compile_blocks_once)
    precompile: bool = False  # save the compiled model per rank in Inductor's cache dir; the next run loads it
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    max_norm: float = 0.0  # gradient clipping; 0: off
    # with clipping on a compiled SimpleFSDP model: each gradient's squares summed in backward
    # (simplefsdp.grad_squares), so the norm reads no gradient
    norm_in_backward: bool = True
    # CPU ranks: Inductor's vectorised C++ kernels; false (default): scalar kernels, which gcc
    # compiles in less time (the CPU jobs this CLI runs are short, and most of them is compiling)
    cpu_simd: bool = False
    baseline: str = "simplefsdp"  # one of BASELINES


@dataclass
class Checkpoint:
    folder: str = ""  # default: <metrics.out_dir>/checkpoints
    interval: int = 0  # save every K steps (and at the end); 0: only at the end
    resume: bool = False


@dataclass
class Metrics:
    out_dir: str = ""  # default: runs/<config name>[-fsdp2]; metrics.jsonl goes there
    tensorboard: bool = False
    peak_tflops: float = 0.0  # the device's peak for MFU; 0: from a table of known GPUs


SECTIONS = {"parallel": Parallel, "training": Training, "checkpoint": Checkpoint, "metrics": Metrics}


@dataclass
class JobConfig:
    name: str = "default"
    model: dict = field(default_factory=lambda: {"kind": "dense"})
    parallel: Parallel = field(default_factory=Parallel)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)

    def model_config(self):
        """The model's config; its rotary tables cover ``training.seq_len`` unless ``model.max_seq_len`` says.
        For ``kind = "hf"``, the transformers config."""
        if self.model["kind"] == HF:
            from simplefsdp.models.hf import hf_config

            fields = {k: v for k, v in self.model.items() if k not in ("kind", *HF_KEYS)}
            return hf_config(self.model.get("model_type"), self.model.get("config"), **fields)
        fields = {"max_seq_len": self.training.seq_len, **self.model}
        return MODEL_KINDS[fields.pop("kind")](**fields)

    @property
    def out_dir(self) -> str:
        suffix = "" if self.training.baseline == "simplefsdp" else f"-{self.training.baseline}"
        return self.metrics.out_dir or os.path.join("runs", self.name + suffix)

    @property
    def checkpoint_folder(self) -> str:
        return self.checkpoint.folder or os.path.join(self.out_dir, "checkpoints")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def degrees(self, world: int) -> dict[str, int]:
        """The mesh degrees for ``world`` ranks, dp_shard = -1 resolved (validated already)."""
        p = self.parallel
        dp_shard = p.dp_shard if p.dp_shard != -1 else world // (p.dp_replicate * p.tp)
        return {"dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "tp": p.tp}


def _parse_value(key: str, kind, raw):
    """``raw`` (from TOML, or a string from the command line) as ``kind``."""
    if isinstance(raw, str) and kind is not str:
        text = raw.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return text in ("true", "1", "yes", "on")
            return kind(text)
        except ValueError:
            raise ConfigError(f"{key}: expected {kind.__name__}, got {raw!r}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if type(raw) is not kind:
        raise ConfigError(f"{key}: expected {kind.__name__}, got {raw!r}")
    return raw


def _parse_any(raw):
    """A transformers config value: TOML's own, or from the command line a JSON literal (else the string)."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _model_fields(kind: str) -> dict[str, type]:
    hints = typing.get_type_hints(MODEL_KINDS[kind])
    return {f.name: hints[f.name] for f in dataclasses.fields(MODEL_KINDS[kind])}


def _set(cfg: JobConfig, key: str, raw) -> None:
    section, _, name = key.partition(".")
    if section == "name" and not name:
        cfg.name = _parse_value("name", str, raw)
        return
    if section == "model":
        if name == "kind":
            kind = _parse_value(key, str, raw)
            if kind not in (*MODEL_KINDS, HF):
                raise ConfigError(f"model.kind: must be one of {sorted([*MODEL_KINDS, HF])}, got {kind!r}")
            cfg.model["kind"] = kind
            return
        if cfg.model["kind"] == HF:  # checked against the transformers config in validate()
            cfg.model[name] = _parse_value(key, str, raw) if name in HF_KEYS else _parse_any(raw)
            return
        # checked against the final kind in validate(); every MoE field is a candidate here
        fields = _model_fields("moe")
        if name not in fields:
            raise ConfigError(f"{key}: unknown key (model keys: kind, {', '.join(fields)})")
        cfg.model[name] = _parse_value(key, fields[name], raw)
        return
    if section not in SECTIONS or not name:
        raise ConfigError(f"{key}: unknown section (sections: model, {', '.join(SECTIONS)})")
    hints = typing.get_type_hints(SECTIONS[section])
    if name not in hints:
        raise ConfigError(f"{key}: unknown key (in [{section}]: {', '.join(hints)})")
    setattr(getattr(cfg, section), name, _parse_value(key, hints[name], raw))


def load(path: str | None, overrides: list[tuple[str, str]] = ()) -> JobConfig:
    """The config in the TOML file ``path`` (None: the defaults), then ``overrides`` applied."""
    cfg = JobConfig()
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"config: cannot read {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: {path} is not valid TOML: {e}") from None
        cfg.name = os.path.splitext(os.path.basename(path))[0]
        model = data.pop("model", {})
        if "kind" in model:  # first, so that its fields are checked against it
            _set(cfg, "model.kind", model.pop("kind"))
        for key, value in model.items():
            _set(cfg, f"model.{key}", value)
        for section, values in data.items():
            if not isinstance(values, dict):
                _set(cfg, section, values)
                continue
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value)
    for key, value in overrides:
        _set(cfg, key, value)
    return cfg


def _writable(folder: str) -> bool:
    """Whether ``folder`` exists and is writable, or its nearest existing parent would let it be made."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _validate_native(cfg: JobConfig):
    """The model section of this project's models; returns their config."""
    kind = cfg.model["kind"]
    allowed = _model_fields(kind)
    for name in cfg.model:
        _check(name == "kind" or name in allowed, f"model.{name}", f"not a field of {kind} models (model.kind = {kind!r})")
    m = cfg.model_config()
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        _check(getattr(m, name) >= 1, f"model.{name}", f"must be >= 1, got {getattr(m, name)}")
    _check(m.dim % m.n_heads == 0, "model.n_heads", f"{m.n_heads} does not divide model.dim {m.dim}")
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", f"{m.n_kv_heads} does not divide model.n_heads {m.n_heads}")
    _check(m.head_dim % 2 == 0, "model.dim", f"head dim {m.head_dim} (dim / n_heads) must be even for rotary embeddings")
    _check(m.rope_theta > 0 and math.isfinite(m.rope_theta), "model.rope_theta", f"must be a positive number, got {m.rope_theta}")
    _check(m.norm_eps >= 0 and math.isfinite(m.norm_eps), "model.norm_eps", f"must be >= 0, got {m.norm_eps}")
    if kind == "moe":
        for name in ("num_experts", "expert_dim"):
            _check(getattr(m, name) >= 1, f"model.{name}", f"must be >= 1, got {getattr(m, name)}")
        _check(m.num_shared_experts >= 0, "model.num_shared_experts", f"must be >= 0, got {m.num_shared_experts}")
        _check(m.route_scale > 0 and math.isfinite(m.route_scale), "model.route_scale", f"must be a positive number, got {m.route_scale}")
        _check(1 <= m.top_k <= m.num_experts, "model.top_k", f"must be in 1..num_experts ({m.num_experts}), got {m.top_k}")
        _check(0 <= m.n_dense_layers <= m.n_layers, "model.n_dense_layers", f"must be in 0..n_layers ({m.n_layers})")
        _check(m.score_func in ("sigmoid", "softmax"), "model.score_func", f"must be sigmoid or softmax, got {m.score_func!r}")
    return m


def _validate_hf(cfg: JobConfig):
    """model_type or config (one of them), and only fields the transformers config has; returns the config."""
    _check(importlib.util.find_spec("transformers") is not None, "model.kind", "'hf' needs the transformers package")
    model = cfg.model
    _check(("model_type" in model) != ("config" in model), "model.model_type",
           "give exactly one of model.model_type (a transformers model type) and model.config (a config.json)")
    if "config" in model:
        _check(os.path.isfile(model["config"]), "model.config", f"no such file: {model['config']!r}")
    from simplefsdp.models.hf import hf_config

    try:
        default = hf_config(model.get("model_type"), model.get("config"))
    except (ValueError, KeyError, OSError) as e:
        key = "model.config" if "config" in model else "model.model_type"
        raise ConfigError(f"{key}: transformers cannot make a config of {model.get('config') or model.get('model_type')!r} "
                          f"({str(e).split('.')[0]})") from None
    for name in model:
        _check(name in ("kind", *HF_KEYS) or hasattr(default, name), f"model.{name}",
               f"not a field of {type(default).__name__}")
    config = cfg.model_config()
    if "weights" in model:
        _check_hf_weights(config, model["weights"])
    return config


def _check_hf_weights(config, directory: str) -> None:
    """The weights fit the model the config describes (file headers only, a meta-device model)."""
    import torch

    from simplefsdp.models.hf import hf_causal_lm
    from simplefsdp.models.hf_weights import check_hf_weights

    _check(os.path.isdir(directory), "model.weights", f"no such directory: {directory!r}")
    with torch.device("meta"):
        model = hf_causal_lm(config)
    try:
        check_hf_weights(model, directory)
    except ValueError as e:
        raise ConfigError(f"model.weights: {e}") from None


def _validate_hf_baseline(cfg: JobConfig, world: int) -> None:
    """transformers' own expert parallelism (:mod:`simplefsdp.baselines.hf_ep`): what it can run."""
    p, t = cfg.parallel, cfg.training
    _check(cfg.model["kind"] == HF, "training.baseline", "hf (transformers' own expert parallelism) needs model.kind = 'hf'")
    _check("weights" in cfg.model, "model.weights",
           "the hf baseline loads through from_pretrained: give a save_pretrained directory")
    _check(importlib.util.find_spec("accelerate") is not None, "training.baseline",
           "the hf baseline needs the accelerate package (transformers asks for it with a tp_plan)")
    _check(p.ep == world, "parallel.ep", f"the hf baseline's expert parallelism spans all {world} ranks, "
           f"with the whole batch on each (no data parallelism); set parallel.ep {world}")
    _check(cfg.model.get("experts_implementation", "grouped_mm") == "grouped_mm", "model.experts_implementation",
           "the hf baseline needs grouped_mm: under transformers' (5.17) expert parallelism batched_mm gives wrong "
           "gradients and eager fails on the sentinel expert ids")
    _check(not t.compile, "training.compile", "the hf baseline runs eagerly (set training.compile false)")
    _check(t.param_dtype == t.reduce_dtype == "float32", "training.param_dtype",
           "the hf baseline trains in the checkpoint's dtype, without a mixed-precision policy (set float32)")


def _hf_num_experts(config) -> int | None:
    """The routed-expert count of a transformers config (its families name it differently)."""
    return next((getattr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(config, n, None)), None)


def validate(cfg: JobConfig, world: int) -> None:
    """Check everything that can be checked before a rank starts, for ``world`` ranks."""
    kind = cfg.model["kind"]
    m = _validate_hf(cfg) if kind == HF else _validate_native(cfg)
    # (key, value) of the model's positions and routed experts
    positions = ("model.max_position_embeddings", m.max_position_embeddings) if kind == HF else ("model.max_seq_len", m.max_seq_len)
    experts = ("the model's routed experts", _hf_num_experts(m)) if kind == HF else ("model.num_experts", getattr(m, "num_experts", None))

    p, t = cfg.parallel, cfg.training
    for name in ("dp_replicate", "tp", "ep"):
        _check(getattr(p, name) >= 1, f"parallel.{name}", f"must be >= 1, got {getattr(p, name)}")
    _check(p.ep_chunks >= 0, "parallel.ep_chunks", f"must be >= 1 (or 0: the default), got {p.ep_chunks}")
    _check(p.ep > 1 or p.ep_chunks <= 1, "parallel.ep_chunks", f"{p.ep_chunks} needs parallel.ep > 1 (no all-to-all to overlap)")
    _check(p.dp_shard >= 1 or p.dp_shard == -1, "parallel.dp_shard", f"must be >= 1 or -1 (the ranks left over), got {p.dp_shard}")
    if p.dp_shard == -1:
        _check(world % (p.dp_replicate * p.tp) == 0, "parallel.dp_shard",
               f"-1: {world} ranks do not split into dp_replicate {p.dp_replicate} x tp {p.tp}")
    d = cfg.degrees(world)
    product = d["dp_replicate"] * d["dp_shard"] * d["tp"]
    _check(product == world, "parallel.dp_shard",
           f"dp_replicate {d['dp_replicate']} x dp_shard {d['dp_shard']} x tp {d['tp']} = {product}, but there are {world} ranks")
    _check(p.mode in ("auto", "fully_shard", "replicate", "hybrid_shard"), "parallel.mode",
           f"must be auto, fully_shard, replicate or hybrid_shard, got {p.mode!r}")
    _check(p.activation_checkpoint in ("none", "full", "selective"), "parallel.activation_checkpoint",
           f"must be none, full or selective, got {p.activation_checkpoint!r}")
    needs = {"fully_shard": ("dp_replicate", 1, "== 1"), "replicate": ("dp_shard", 1, "== 1"), "hybrid_shard": ("dp_replicate", 2, ">= 2")}
    if p.mode in needs:
        dim, bound, text = needs[p.mode]
        fits = d[dim] == 1 if text == "== 1" else d[dim] >= bound
        _check(fits, "parallel.mode", f"{p.mode} needs parallel.{dim} {text}; the degrees give {dim} {d[dim]}")
        _check(p.mode != "replicate" or p.ep == 1, "parallel.mode", "replicate has no dp_shard dim to split into edp x ep")
    if p.tp > 1:
        _check(kind != HF, "parallel.tp", "the tensor-parallel plan covers this project's models, not HF models")
        for name in ("n_heads", "n_kv_heads", "ffn_dim"):  # the TP plan splits heads and the dense MLP
            _check(getattr(m, name) % p.tp == 0, "parallel.tp", f"{p.tp} does not divide model.{name} {getattr(m, name)}")
    if p.ep > 1:
        _check(experts[1] is not None, "parallel.ep", f"expert parallelism needs model.kind = 'moe' (or an HF MoE model), got {kind!r}")
        _check((d["dp_shard"] * p.tp) % p.ep == 0, "parallel.ep",
               f"{p.ep} does not divide dp_shard {d['dp_shard']} x tp {p.tp} (the ranks experts are spread over)")
        _check(experts[1] % p.ep == 0, "parallel.ep", f"{p.ep} does not divide {experts[0]} {experts[1]}")

    if t.blocks_once:
        _check(t.compile and t.baseline == "simplefsdp", "training.blocks_once",
               "compiles SimpleFSDP's blocks once; it needs training.compile and the simplefsdp baseline")
        _check(p.tp == 1, "training.blocks_once", f"blocks compiled once do not take tensor parallelism (parallel.tp {p.tp}); "
               "set training.blocks_once false")
    if t.precompile:
        _check(t.compile and t.baseline == "simplefsdp", "training.precompile",
               "saves SimpleFSDP's compiled model; it needs training.compile and the simplefsdp baseline")
        _check(not t.blocks_once, "training.precompile", "torch cannot save blocks compiled once (a guard of their "
               "regions does not serialise); set training.blocks_once false")
        _check(cfg.model["kind"] != HF, "training.precompile", "torch cannot save a compiled Hugging Face model (an "
               "ID_MATCH guard does not serialise)")
    _check(t.steps >= 1, "training.steps", f"must be >= 1, got {t.steps}")
    _check(t.lr > 0 and math.isfinite(t.lr), "training.lr", f"must be a positive number, got {t.lr}")
    _check(t.seq_len >= 1, "training.seq_len", f"must be >= 1, got {t.seq_len}")
    _check(t.seq_len <= positions[1], "training.seq_len", f"{t.seq_len} exceeds {positions[0]} {positions[1]}")
    dp = d["dp_replicate"] * d["dp_shard"]
    _check(t.global_batch >= dp and t.global_batch % dp == 0, "training.global_batch",
           f"{t.global_batch} sequences do not split evenly over {dp} data-parallel ranks")
    for name in ("param_dtype", "reduce_dtype"):
        _check(getattr(t, name) in DTYPES, f"training.{name}", f"must be one of {DTYPES}, got {getattr(t, name)!r}")
    _check(t.max_norm >= 0, "training.max_norm", f"must be >= 0 (0: no clipping), got {t.max_norm}")
    _check(t.baseline in BASELINES, "training.baseline", f"must be one of {', '.join(BASELINES)}, got {t.baseline!r}")
    if t.baseline == "hf":
        _validate_hf_baseline(cfg, world)
    if t.baseline == "fsdp2":
        _check(p.tp == 1, "parallel.tp", "the fsdp2 baseline has no tensor parallelism")
        _check(p.mode == "auto", "parallel.mode", "the fsdp2 baseline takes its mode from the degrees (leave mode = 'auto')")
    if t.dataset != "synthetic":
        _check(os.path.isfile(t.dataset), "training.dataset", f"no such file: {t.dataset!r}")
        _check(os.path.splitext(t.dataset)[1] in (".txt", ".bin", ".pt"), "training.dataset",
               f"must be 'synthetic' or a .txt, .bin or .pt file, got {t.dataset!r}")

    c = cfg.checkpoint
    _check(c.interval >= 0, "checkpoint.interval", f"must be >= 0, got {c.interval}")
    for key, folder in (("metrics.out_dir", cfg.out_dir), ("checkpoint.folder", cfg.checkpoint_folder)):
        _check(_writable(folder), key, f"cannot create or write {folder!r}")
    if cfg.metrics.tensorboard:
        _check(importlib.util.find_spec("tensorboard") is not None, "metrics.tensorboard", "the tensorboard package is not installed")
    _check(cfg.metrics.peak_tflops >= 0, "metrics.peak_tflops", f"must be >= 0, got {cfg.metrics.peak_tflops}")


def model_fingerprint(cfg: JobConfig) -> str:
    """The model section as canonical JSON: checkpoints of different models never mix.

    ``max_seq_len`` is left out: it sizes the rotary tables, which are not saved.
    """
    if cfg.model["kind"] == HF:
        return json.dumps(cfg.model_config().to_diff_dict() | {"kind": HF}, sort_keys=True, default=str)
    fields = dataclasses.asdict(cfg.model_config())
    del fields["max_seq_len"]
    return json.dumps(fields | {"kind": cfg.model["kind"]}, sort_keys=True)


def tracks_grad_squares(cfg: JobConfig) -> bool:
    """Whether the job sums its gradients' squares in backward (``training.norm_in_backward``):
    where it clips a compiled SimpleFSDP model. Eagerly each square would be a kernel of its own,
    no cheaper than the norm's multi-tensor read."""
    t = cfg.training
    return t.norm_in_backward and t.max_norm > 0 and t.baseline == "simplefsdp" and t.compile


def compiled_fingerprint(cfg: JobConfig) -> str:
    """What of the config a compiled model depends on, as canonical JSON: the model, the parallel
    layout and the training settings that reach the graph."""
    t = cfg.training
    graph = {k: getattr(t, k) for k in (
        "param_dtype", "reduce_dtype", "passes", "blocks_once", "cpu_simd", "global_batch", "seq_len")}
    graph["grad_squares"] = tracks_grad_squares(cfg)
    return json.dumps({"model": model_fingerprint(cfg), "parallel": dataclasses.asdict(cfg.parallel), "training": graph},
                      sort_keys=True)
