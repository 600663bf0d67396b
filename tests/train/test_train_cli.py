"""The training entry point: CLI runs on CPU ranks, checkpoint resume (after a kill, and into
another parallel layout), the FSDP2 baseline, the compare tool, and config errors."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from simplefsdp.train import cli as train, compare
from simplefsdp.train.metrics import read_records

# most tests here launch ranks through the CLI; the rest are quick config errors
pytestmark = pytest.mark.ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE, MOE, HF_MOE = (os.path.join(REPO, "configs", f"debug_{m}.toml") for m in ("dense", "moe", "hf_moe"))


def _train(config, out_dir, *overrides):
    train.main(["--config", config, "--metrics.out_dir", str(out_dir), *map(str, overrides)])
    return [r["loss"] for r in read_records(str(out_dir))]


def _error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit:
        train.main(list(map(str, argv)))
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err.removeprefix("simplefsdp-train: error: ")


@pytest.mark.parametrize(
    "config, overrides, key",
    [
        (MOE, ["--parallel.ep", 3], "parallel.ep: 3 does not divide dp_shard 4"),
        (MOE, ["--model.num_experts", 6, "--parallel.ep", 4], "parallel.ep: 4 does not divide model.num_experts 6"),
        (DENSE, ["--parallel.ep", 2], "parallel.ep: expert parallelism needs model.kind = 'moe'"),
        (MOE, ["--parallel.ep", 1, "--parallel.ep_chunks", 2], "parallel.ep_chunks: 2 needs parallel.ep > 1"),
        (MOE, ["--parallel.ep", 2, "--parallel.ep_chunks", -1], "parallel.ep_chunks: must be >= 1 (or 0: the default), got -1"),
        (DENSE, ["--model.num_experts", 4], "model.num_experts: not a field of dense models"),
        (DENSE, ["--model.n_heads", 5], "model.n_heads: 5 does not divide model.dim 64"),
        (DENSE, ["--ranks", 4, "--parallel.dp_shard", 3], "parallel.dp_shard: dp_replicate 1 x dp_shard 3 x tp 1 = 3, but there are 4 ranks"),
        (DENSE, ["--ranks", 4, "--parallel.tp", 2], "parallel.dp_shard: dp_replicate 1 x dp_shard 4 x tp 2 = 8"),
        (DENSE, ["--training.global_batch", 6], "training.global_batch: 6 sequences do not split evenly over 4"),
        (DENSE, ["--training.steps", "ten"], "training.steps: expected int, got 'ten'"),
        (DENSE, ["--training.compile", "maybe"], "training.compile: expected bool, got 'maybe'"),
        (DENSE, ["--training.param_dtype", "float16"], "training.param_dtype: must be one of"),
        (DENSE, ["--training.stepz", 3], "training.stepz: unknown key (in [training]: steps,"),
        (DENSE, ["--trainin.steps", 3], "trainin.steps: unknown section"),
        (DENSE, ["--parallel.activation_checkpoint", "some"], "parallel.activation_checkpoint: must be none, full or selective"),
        (DENSE, ["--baseline", "fsdp2", "--ranks", 4, "--parallel.dp_shard", 2, "--parallel.tp", 2],
         "parallel.tp: the fsdp2 baseline has no tensor parallelism"),
        (DENSE, ["--training.dataset", "/no/such/file.txt"], "training.dataset: no such file"),
        (DENSE, ["steps", 3], "steps: unrecognized argument"),
        (DENSE, ["--ranks", 4, "--parallel.mode", "replicate"],
         "parallel.mode: replicate needs parallel.dp_shard == 1; the degrees give dp_shard 4"),
        (DENSE, ["--ranks", 4, "--parallel.mode", "hybrid_shard"],
         "parallel.mode: hybrid_shard needs parallel.dp_replicate >= 2; the degrees give dp_replicate 1"),
        (DENSE, ["--ranks", 4, "--parallel.dp_replicate", 2, "--parallel.dp_shard", 2, "--parallel.mode", "fully_shard"],
         "parallel.mode: fully_shard needs parallel.dp_replicate == 1; the degrees give dp_replicate 2"),
        (DENSE, ["--ranks", 4, "--parallel.dp_shard", 2, "--parallel.tp", 2, "--model.ffn_dim", 161],
         "parallel.tp: 2 does not divide model.ffn_dim 161"),
        (MOE, ["--model.expert_dim", 0], "model.expert_dim: must be >= 1, got 0"),
        (MOE, ["--model.num_shared_experts", -1], "model.num_shared_experts: must be >= 0, got -1"),
        (DENSE, ["--model.rope_theta", 0], "model.rope_theta: must be a positive number, got 0"),
        (DENSE, ["--model.norm_eps", -1e-5], "model.norm_eps: must be >= 0, got -1e-05"),
        (DENSE, ["--model.max_seq_len", 16, "--training.seq_len", 32], "training.seq_len: 32 exceeds model.max_seq_len 16"),
        (DENSE, ["--training.lr", "nan"], "training.lr: must be a positive number, got nan"),
        (DENSE, ["--training.blocks_once", "true", "--training.compile", "false"],
         "training.blocks_once: compiles SimpleFSDP's blocks once; it needs training.compile"),
        (DENSE, ["--ranks", 4, "--parallel.dp_shard", 2, "--parallel.tp", 2, "--training.blocks_once", "true"],
         "training.blocks_once: blocks compiled once do not take tensor parallelism (parallel.tp 2)"),
        (DENSE, ["--training.precompile", "true", "--training.compile", "false"],
         "training.precompile: saves SimpleFSDP's compiled model; it needs training.compile"),
        (DENSE, ["--training.precompile", "true", "--training.blocks_once", "true"],
         "training.precompile: torch cannot save blocks compiled once"),
        (HF_MOE, ["--training.precompile", "true"], "training.precompile: torch cannot save a compiled Hugging Face model"),
        (DENSE, ["--training.lr", "inf"], "training.lr: must be a positive number, got inf"),
        (HF_MOE, ["--model.hidden_sise", 32], "model.hidden_sise: not a field of Qwen3MoeConfig"),
        (HF_MOE, ["--model.model_type", "qwen9"], "model.model_type: transformers cannot make a config of 'qwen9'"),
        (HF_MOE, ["--model.config", "/no/config.json"], "model.model_type: give exactly one of model.model_type"),
        (HF_MOE, ["--parallel.ep", 4, "--model.num_experts", 6], "parallel.ep: 4 does not divide the model's routed experts 6"),
        (HF_MOE, ["--parallel.ep", 1, "--parallel.dp_shard", 2, "--parallel.tp", 2],
         "parallel.tp: the tensor-parallel plan covers this project's models, not HF models"),
        (HF_MOE, ["--training.seq_len", 256], "training.seq_len: 256 exceeds model.max_position_embeddings 128"),
    ],
)
def test_bad_config_value_is_one_line_naming_the_key(config, overrides, key, capsys, tmp_path):
    assert _error(capsys, "--config", config, "--metrics.out_dir", tmp_path, *overrides).startswith(key)


def test_bad_toml_and_tokens_name_the_key(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nkind = 'dense'\ndim = 'wide'\n")
    assert _error(capsys, "--config", bad).startswith("model.dim: expected int, got 'wide'")
    text = tmp_path / "tiny.txt"
    text.write_text("héllo world, " * 20)
    assert _error(capsys, "--config", DENSE, "--training.dataset", text, "--model.vocab_size", 128).startswith(
        "training.dataset: "  # bytes >= 128 (UTF-8 of é) are not token ids of a 128-token vocabulary
    )


def test_unwritable_folders_and_resume_without_a_checkpoint_are_refused(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _error(capsys, "--config", DENSE, "--metrics.out_dir", blocker / "run")
    assert err.startswith(f"metrics.out_dir: cannot create or write '{blocker / 'run'}'")
    err = _error(capsys, "--config", DENSE, "--metrics.out_dir", tmp_path, "--checkpoint.folder", blocker / "ckpt")
    assert err.startswith(f"checkpoint.folder: cannot create or write '{blocker / 'ckpt'}'")
    err = _error(capsys, "--config", DENSE, "--metrics.out_dir", tmp_path, "--resume")
    assert err.startswith(f"checkpoint.folder: --resume, but {tmp_path / 'checkpoints'} holds no checkpoint")


def test_checkpoint_folder_of_another_model_is_refused(capsys, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.json").write_text('{"kind": "dense", "dim": 32}')
    err = _error(capsys, "--config", DENSE, "--checkpoint.folder", folder, "--resume")
    assert err.startswith(f"checkpoint.folder: {folder} holds checkpoints of a different model config")
    os.remove(folder / "model.json")
    (folder / "step-00000005").mkdir()
    err = _error(capsys, "--config", DENSE, "--checkpoint.folder", folder)
    assert err.startswith(f"checkpoint.folder: {folder} already holds checkpoints (last: step 5); pass --resume")


def test_debug_moe_trains_compiled_on_4_ranks(tmp_path, capfd):
    """README's main job: the loss falls well below uniform (log 256 = 5.55) in 30 steps."""
    losses = _train(MOE, tmp_path, "--checkpoint.interval", 0)
    out = capfd.readouterr().out  # rank 0 prints: its fd, not this process's sys.stdout
    assert "SimpleFSDP compiled with passes on 4 cpu ranks (dp_shard 4 x ep 2)" in out
    assert "the first step compiles the model" in out  # the first step's minutes are not silent
    assert "step 30/30 [####################]" in out
    assert len(losses) == 30 and losses[-1] < 0.5 * math.log(256), losses
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["model.json", "step-00000030"]


@pytest.mark.slow
def test_debug_dense_trains_compiled_on_4_ranks(tmp_path, capfd):
    losses = _train(DENSE, tmp_path, "--training.steps", 5, "--checkpoint.interval", 2)
    out = capfd.readouterr().out
    assert "dense model" in out and "SimpleFSDP compiled with passes on 4 cpu ranks (dp_shard 4)" in out
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["model.json", "step-00000002", "step-00000004", "step-00000005"]


@pytest.mark.slow  # about 30 s; tests/moe/test_hf_models.py checks HF parity in the default suite
def test_debug_hf_moe_trains_on_4_ranks_like_fsdp2(tmp_path, capfd):
    """An unmodified HF Qwen3-MoE, eager FSDP4 x EP2: the loss falls, and --baseline fsdp2 gives the
    same losses bit for bit."""
    args = ["--training.compile", "false", "--training.steps", 5, "--checkpoint.interval", 0]
    ours = _train(HF_MOE, tmp_path / "simplefsdp", *args)
    assert "debug_hf_moe: hf model" in capfd.readouterr().out
    theirs = _train(HF_MOE, tmp_path / "fsdp2", *args, "--baseline", "fsdp2")
    assert ours == theirs and ours[-1] < ours[0], (ours, theirs)


def _hf_weights(directory, **fields) -> str:
    """A save_pretrained directory of debug_hf_moe's model (``fields`` changed) whose lm_head is zero."""
    import torch

    from simplefsdp.models.hf import hf_causal_lm
    from simplefsdp.train.config import load

    cfg = load(HF_MOE)
    cfg.model.update(fields)
    torch.manual_seed(5)
    model = hf_causal_lm(cfg.model_config())
    torch.nn.init.zeros_(model.lm_head.weight)
    model.save_pretrained(directory)
    return str(directory)


def test_hf_weights_that_do_not_fit_are_one_line_naming_the_key(capsys, tmp_path):
    weights = _hf_weights(tmp_path / "weights", moe_intermediate_size=16)
    capsys.readouterr()  # save_pretrained's progress bar
    err = _error(capsys, "--config", HF_MOE, "--metrics.out_dir", tmp_path, "--model.weights", weights)
    assert err.startswith(f"model.weights: {weights}: model.layers.0.mlp.experts.down_proj: the checkpoint's is "
                          "(8, 64, 16), the model's (8, 64, 32)"), err
    err = _error(capsys, "--config", HF_MOE, "--metrics.out_dir", tmp_path, "--model.weights", tmp_path / "none")
    assert err.startswith(f"model.weights: no such directory: '{tmp_path / 'none'}'")


def test_hf_baseline_settings_it_cannot_run_are_one_line_naming_the_key(capsys, tmp_path):
    weights = _hf_weights(tmp_path / "weights")
    capsys.readouterr()  # save_pretrained's progress bar
    eager = ["--config", HF_MOE, "--metrics.out_dir", tmp_path, "--baseline", "hf", "--training.compile", "false"]
    cases = [
        ([], "model.weights: the hf baseline loads through from_pretrained"),
        (["--model.weights", weights], "parallel.ep: the hf baseline's expert parallelism spans all 4 ranks"),
        (["--model.weights", weights, "--ranks", 2, "--parallel.dp_shard", 2],
         "model.experts_implementation: the hf baseline needs grouped_mm"),
        (["--model.weights", weights, "--ranks", 2, "--parallel.dp_shard", 2, "--model.experts_implementation",
          "grouped_mm", "--training.compile", "true"], "training.compile: the hf baseline runs eagerly"),
        (["--model.weights", weights, "--ranks", 2, "--parallel.dp_shard", 2, "--model.experts_implementation",
          "grouped_mm", "--training.param_dtype", "bfloat16"],
         "training.param_dtype: the hf baseline trains in the checkpoint's dtype"),
    ]
    for overrides, message in cases:
        assert _error(capsys, *eager, *overrides).startswith(message)
    assert _error(capsys, "--config", MOE, "--metrics.out_dir", tmp_path, "--baseline", "hf").startswith(
        "training.baseline: hf (transformers' own expert parallelism) needs model.kind = 'hf'")


@pytest.mark.slow
def test_hf_baseline_trains_like_simplefsdp(tmp_path, capfd):
    """transformers' own expert parallelism (every rank the whole batch, experts Shard(0) over all
    ranks, outputs all-reduced) and SimpleFSDP (FSDP2 x EP2, all-to-all) train the same model
    from the same weights to the same losses, up to the order of float sums (seen: 4.8e-7 over 6
    steps; with batched_mm experts, which the baseline refuses, HF's were 2.5e-3 off by step 4)."""
    args = ["--training.compile", "false", "--training.steps", 6, "--checkpoint.interval", 0, "--ranks", 2,
            "--parallel.dp_shard", 2, "--model.experts_implementation", "grouped_mm",
            "--model.weights", _hf_weights(tmp_path / "weights")]
    ours = _train(HF_MOE, tmp_path / "simplefsdp", *args)
    theirs = _train(HF_MOE, tmp_path / "hf", *args, "--baseline", "hf")
    assert "transformers' expert parallelism eager on 2 cpu ranks (ep 2)" in capfd.readouterr().out
    assert abs(ours[0] - theirs[0]) < 1e-6 and max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-5, (ours, theirs)


@pytest.mark.slow
def test_debug_hf_moe_starts_from_hf_weights(tmp_path):
    """[model] weights: a save_pretrained directory whose lm_head is zero gives uniform logits, so
    the first loss is ln(vocab). SimpleFSDP (built on meta, each rank reading its slices) and
    FSDP2 (built whole, loaded before sharding) then take the same second step bit for bit, which
    every loaded weight shapes."""
    args = ["--training.compile", "false", "--training.steps", 2, "--checkpoint.interval", 0,
            "--model.weights", _hf_weights(tmp_path / "weights")]
    ours = _train(HF_MOE, tmp_path / "simplefsdp", *args)
    theirs = _train(HF_MOE, tmp_path / "fsdp2", *args, "--baseline", "fsdp2")
    assert abs(ours[0] - math.log(256)) < 1e-6 and ours == theirs, (ours, theirs)


@pytest.mark.slow
def test_debug_hf_moe_trains_compiled_on_4_ranks(tmp_path, capfd):
    """Compiled with the passes, the HF model follows its eager run (seen: 5.56 -> 4.88 in 8 steps)."""
    args = ["--training.steps", 8, "--checkpoint.interval", 0]
    compiled = _train(HF_MOE, tmp_path / "compiled", *args)
    assert "SimpleFSDP compiled with passes on 4 cpu ranks (dp_shard 4 x ep 2)" in capfd.readouterr().out
    eager = _train(HF_MOE, tmp_path / "eager", *args, "--training.compile", "false")
    assert max(abs(a - b) for a, b in zip(compiled, eager, strict=True)) < 1e-4, (compiled, eager)
    assert compiled[-1] < compiled[0] - 0.5, compiled


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _rank_pids(pid: int) -> list[int]:
    """The launcher's rank processes (spawned children; not multiprocessing's resource tracker)."""
    pids = []
    for child in _children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                pids.append(child)
    return pids


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_losses(tmp_path):
    """SIGKILL one rank after the first checkpoint; --resume continues from the last complete
    checkpoint and every step's loss equals the uninterrupted run's, bit for bit (eager FSDP4 x EP2)."""
    args = ["--training.compile", "false", "--training.steps", 12, "--checkpoint.interval", 3]
    uninterrupted = _train(MOE, tmp_path / "whole", *args)

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "simplefsdp.train", "--config", MOE, "--metrics.out_dir", out, *args]
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not os.path.isdir(out / "checkpoints" / "step-00000003"):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.kill(_rank_pids(proc.pid)[-1], signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    steps_done = len(read_records(str(out)))
    assert steps_done < 12, "the kill came after the last step"

    resumed = _train(MOE, out, *args, "--resume")
    assert resumed == uninterrupted


@pytest.mark.slow
def test_resume_in_another_layout(tmp_path):
    """Saved at FSDP4 (4 ranks), resumed at FSDP2 x EP2 (2 ranks): DCP reshards every parameter
    and optimizer state; the losses continue those of the run that did not stop."""
    args = ["--training.compile", "false", "--parallel.ep", 1]
    whole = _train(MOE, tmp_path / "whole", *args, "--training.steps", 6)
    first = _train(MOE, tmp_path / "split", *args, "--training.steps", 3)
    resumed = _train(MOE, tmp_path / "split", "--training.compile", "false", "--training.steps", 6, "--resume",
                     "--ranks", 2, "--parallel.dp_shard", 2, "--parallel.ep", 2)
    assert first == whole[:3] and resumed[:3] == first
    assert max(abs(a - b) for a, b in zip(resumed[3:], whole[3:], strict=True)) < 1e-5, (resumed, whole)


@pytest.mark.slow
def test_fsdp2_baseline_checkpoints_every_expert(tmp_path):
    """FSDP2 FSDP4 x EP2 saves each ep rank's experts as shards of all experts: it resumes in its
    own layout with the losses of the run that did not stop (before, every ep rank wrote its
    experts under one key, the checkpoint kept one rank's, and step 4 was off by 0.16), and into
    FSDP2 without ep and SimpleFSDP FSDP4 x EP2."""
    args = ["--training.compile", "false", "--baseline", "fsdp2"]
    whole = _train(MOE, tmp_path / "whole", *args, "--training.steps", 6)
    first = _train(MOE, tmp_path / "split", *args, "--training.steps", 3)
    assert first == whole[:3]
    for layout in (["--baseline", "fsdp2"], ["--baseline", "fsdp2", "--parallel.ep", 1], ["--parallel.ep", 2]):
        resumed = _train(MOE, tmp_path / "split", "--training.compile", "false", "--training.steps", 6, "--resume",
                         "--checkpoint.interval", 3, *layout)
        shutil.rmtree(tmp_path / "split" / "checkpoints" / "step-00000006")
        assert resumed[:3] == first
        assert max(abs(a - b) for a, b in zip(resumed[3:], whole[3:], strict=True)) < 1e-5, (layout, resumed, whole)


@pytest.mark.slow
def test_hf_moe_resumes_in_another_layout(tmp_path):
    """An HF model's DCP checkpoint, saved at FSDP4 x EP2 (4 ranks), resumes at FSDP2 x EP2 (2 ranks, edp 1)."""
    args = ["--training.compile", "false"]
    whole = _train(HF_MOE, tmp_path / "whole", *args, "--training.steps", 6)
    first = _train(HF_MOE, tmp_path / "split", *args, "--training.steps", 3)
    resumed = _train(HF_MOE, tmp_path / "split", *args, "--training.steps", 6, "--resume",
                     "--ranks", 2, "--parallel.dp_shard", 2)
    assert first == whole[:3] and resumed[:3] == first
    assert max(abs(a - b) for a, b in zip(resumed[3:], whole[3:], strict=True)) < 1e-5, (resumed, whole)


@pytest.mark.slow
def test_fsdp2_baseline_matches_bitwise_and_compare_shows_it(tmp_path, capsys):
    """Eager FSDP4 x EP2: SimpleFSDP and --baseline fsdp2 give the same losses bit for bit."""
    args = ["--training.compile", "false", "--training.steps", 5]
    ours = _train(MOE, tmp_path / "simplefsdp", *args)
    theirs = _train(MOE, tmp_path / "fsdp2", *args, "--baseline", "fsdp2")
    assert ours == theirs
    capsys.readouterr()
    compare.main([str(tmp_path / "simplefsdp"), str(tmp_path / "fsdp2" / "metrics.jsonl"), "--plot", ""])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "simplefsdp", "fsdp2", "exact", "max", "|diff|"]
    assert [line.split()[3] for line in lines[1:6]] == ["yes"] * 5
    assert lines[-1] == "5/5 steps bit-for-bit equal across 2 runs"


def test_compare_table_and_plot(tmp_path, capsys):
    for name, losses in {"a": [2.5, 2.25, 2.0], "b": [2.5, 2.25, 2.0078125], "c": [2.5, 2.25]}.items():
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"step": i + 1, "loss": x}) + "\n" for i, x in enumerate(losses))
    png = tmp_path / "loss.png"
    compare.main([str(tmp_path / n) for n in "abc"] + ["--plot", str(png)])
    out = capsys.readouterr().out
    assert out.splitlines()[:5] == [
        "  step             a             b             c  exact  max |diff|",
        "     1      2.500000      2.500000      2.500000    yes           0",
        "     2      2.250000      2.250000      2.250000    yes           0",
        "     3      2.000000      2.007812             -     no     0.00781",
        "2/3 steps bit-for-bit equal across 3 runs",
    ]
    pytest.importorskip("matplotlib")
    assert out.splitlines()[5] == f"plot: {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"step": 1, "loss": 2.5}\n{"step": 2, "lo', "line 2 is not a JSON record (a truncated or non-JSONL file?)"),
        ("step,loss\n1,2.5\n", "line 1 is not a JSON record (a truncated or non-JSONL file?)"),
        ('{"step": 1, "loss": 2.5}\n{"step": 2}\n', "record 2 has no integer 'step' and numeric 'loss'"),
        ('{"loss": 2.5}\n', "record 1 has no integer 'step' and numeric 'loss'"),
        ("", "no records"),
    ],
)
def test_compare_rejects_bad_metrics_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit) as exit:
        compare.main([str(path), "--plot", ""])
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and err[-1] == f"simplefsdp-compare: error: {path}: {message}"


def test_compare_plot_into_a_missing_folder_is_refused_before_reading(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "no-run"), "--plot", str(tmp_path / "missing" / "loss.png")])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"simplefsdp-compare: error: --plot: no folder '{tmp_path / 'missing'}' to write 'loss.png' into"
    )


def test_the_loss_is_compiled_with_the_model_on_a_gpu():
    """Eager fp32 cross entropy took 8.8 ms of an H100 step, compiled 1.5 ms; on CPU ranks it stays eager."""
    from simplefsdp.models.llama import cross_entropy_loss
    from simplefsdp.train.config import load

    compiled_cfg, eager_cfg = (load(DENSE, [("training.compile", flag)]) for flag in ("true", "false"))
    assert train.loss_function(compiled_cfg, "cpu") is cross_entropy_loss
    assert train.loss_function(eager_cfg, "cuda") is cross_entropy_loss
    compiled = train.loss_function(compiled_cfg, "cuda")  # compiles at its first call (on the GPU run)
    assert compiled._torchdynamo_orig_callable is cross_entropy_loss
    compiled_cfg.training.precompile = True
    assert train.loss_function(compiled_cfg, "cuda").target is cross_entropy_loss


def test_the_logits_are_freed_before_the_models_backward():
    import weakref

    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    alive = []

    def loss_fn(logits, labels):  # its backward saves no logits, so nothing should hold them
        ref = weakref.ref(logits)
        loss = logits.sum()
        loss.register_hook(lambda grad: alive.append(ref() is not None))  # runs as backward starts
        return loss

    tokens = torch.randint(0, 16, (2, 4))
    train.train_step(model, torch.optim.AdamW(model.parameters()), (tokens, tokens), params=list(model.parameters()),
                     dp_size=1, loss_fn=loss_fn)
    assert alive == [False]


def test_a_train_step_reads_nothing_back_to_the_host(monkeypatch):
    """It queues the step and returns device tensors: a read would make the host wait for the
    step's kernels, and the next step's launch would leave the GPU idle (on one H100, about 5 ms
    a step for gpu_moe compiled). The CLI reads each step once the next one is queued."""
    import torch

    from simplefsdp.train.metrics import StepReadout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    # torch's AdamW on CPU reads its step counts (CPU tensors) with .item(); SGD reads nothing
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 16, (2, 4))

    def no_read(*args, **kwargs):
        raise AssertionError("train_step read a value back to the host")

    with monkeypatch.context() as patched:
        for name in ("item", "tolist", "cpu", "numpy", "__float__", "__bool__"):
            patched.setattr(torch.Tensor, name, no_read)
        loss, norm = train.train_step(model, optimizer, (tokens, tokens), params=list(model.parameters()), dp_size=1,
                                      max_norm=1.0)
    assert loss.shape == norm.shape == () and loss.requires_grad is False
    assert StepReadout(loss, norm).read() == (loss.item(), norm.item())


def test_the_cli_logs_a_step_once_the_next_is_queued(fake_world, monkeypatch, tmp_path):
    """On a GPU the training loop reads step k's loss after queueing step k + 1, so the GPU runs
    that step's kernels while the host waits. Before a checkpoint is saved every queued step is
    read, and the clock restarts after the save: no step's time holds a save (here 1 s each). The
    records are the same steps in order."""
    import types

    import torch

    from simplefsdp.train.config import load
    from simplefsdp.train.metrics import StepReadout

    cfg = load(DENSE, [("training.steps", "4"), ("training.compile", "false"), ("parallel.dp_shard", "8"),
                       ("checkpoint.interval", "2"), ("metrics.out_dir", str(tmp_path))])
    vocab = cfg.model_config().vocab_size
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))
    events = []
    monkeypatch.setattr(train, "build", lambda *args: (model, model, torch.optim.SGD(model.parameters(), lr=0.1)))
    saving = lambda step: (events.append(f"save {step}"), time.sleep(1.0))
    monkeypatch.setattr(train, "Checkpointer", lambda *args: types.SimpleNamespace(save=saving))
    queue, read = train.train_step, StepReadout.read
    monkeypatch.setattr(train, "train_step", lambda *args, **kwargs: (events.append("queue"), queue(*args, **kwargs))[1])
    monkeypatch.setattr(StepReadout, "read", lambda self: (events.append("read"), read(self))[1])
    monkeypatch.setattr(train, "steps_read_late", lambda device: 1)  # as on a GPU
    losses = train.run(cfg, 0)
    assert events == ["queue", "queue", "read", "read", "save 2", "queue", "queue", "read", "read", "save 4"]
    records = read_records(os.path.join(str(tmp_path), "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4] and [r["loss"] for r in records] == losses
    assert all(math.isfinite(r["loss"]) and 0 < r["step_ms"] < 900 for r in records), [r["step_ms"] for r in records]
    monkeypatch.undo()
    # on the CPU a step has run when train_step returns: it is read at once, so its time is its own
    assert train.steps_read_late(torch.device("cpu")) == 0 and train.steps_read_late(torch.device("cuda")) == 1


@pytest.mark.parametrize("overrides, tracked", [
    ([("training.max_norm", "1.0")], True),
    ([("training.max_norm", "1.0"), ("training.norm_in_backward", "false")], False),
    ([], False),  # no clipping: no norm
    ([("training.max_norm", "1.0"), ("training.baseline", "fsdp2")], False),  # SimpleFSDP's gathers only
    ([("training.max_norm", "1.0"), ("training.compile", "false")], False),  # eagerly no cheaper
])
def test_clipping_jobs_sum_gradient_squares_in_backward(fake_world, overrides, tracked):
    """A job that clips a compiled SimpleFSDP model tracks its gradient squares (simplefsdp.grad_squares),
    and the compiled model's fingerprint (its precompile key) says whether it does."""
    from simplefsdp.grad_squares import tracked_grad_squares
    from simplefsdp.train.config import compiled_fingerprint, load

    cfg = load(MOE, [("parallel.dp_shard", "8"), *overrides])
    model, _, _ = train.build(cfg, 8, "cpu")  # compiled models compile at their first call
    assert (tracked_grad_squares(model) is not None) == tracked
    assert json.loads(compiled_fingerprint(cfg))["training"]["grad_squares"] == tracked


@pytest.mark.parametrize("overrides, scalar", [
    ([], True),
    ([("training.cpu_simd", "true")], False),
    ([("training.baseline", "fsdp2")], True),  # its blocks compile with the same kernels
    ([("training.blocks_once", "true")], True),
])
def test_cpu_jobs_compile_scalar_kernels_unless_asked(fake_world, monkeypatch, overrides, scalar):
    """CPU jobs compile without SIMD (``cpp.simdlen`` 1) as a per-compile option, beside the
    options they already had; ``training.cpu_simd`` gives Inductor's vectorised kernels back. GPU
    jobs: no option. Inductor's global config is left as it was."""
    import torch

    from simplefsdp.train.config import compiled_fingerprint, load

    options = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: options.append(kwargs.get("options")) or fn)
    cfg = load(MOE, [("parallel.dp_shard", "8"), *overrides])
    simdlen = torch._inductor.config.cpp.simdlen
    train.build(cfg, 8, "cpu")
    assert options and all(((o or {}).get("cpp.simdlen") == 1) == scalar for o in options), options
    if cfg.training.blocks_once:
        assert options[0]["allow_buffer_reuse"] is False  # blocks_once's own options are kept
    assert torch._inductor.config.cpp.simdlen == simdlen
    assert train.kernel_options(cfg, "cuda") == {}
    assert json.loads(compiled_fingerprint(cfg))["training"]["cpu_simd"] == (("training.cpu_simd", "true") in overrides)


@pytest.mark.parametrize("backend, cpu_simd, probes", [("gloo", "false", False), ("gloo", "true", True), ("nccl", "false", True)])
def test_a_cpu_job_process_skips_the_vector_isa_probe(monkeypatch, backend, cpu_simd, probes):
    """The rank process of a CPU job without ``training.cpu_simd`` turns Inductor's vector-ISA probe
    off (its compiles are scalar anyway); with it, or on GPUs, the probe runs as before."""
    import torch

    from simplefsdp.train.config import load

    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", None)  # restored after the test
    monkeypatch.setattr(train.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(train, "run", lambda cfg, start: [])
    train._rank_main(load(MOE, [("training.cpu_simd", cpu_simd)]), 0, None)
    assert torch._inductor.config.cpp.vec_isa_ok is (None if probes else False)
