"""The benchmarks' own logic, on CPU: the cost model's simulation and graph capture, the step-time
comparisons and tables, the kernel benchmark's group offsets, RESULTS.md sections.

The benchmarks measure on a GPU and assert nothing; these tests check that what they compute
from their measurements is right.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import comm_model  # noqa: E402
import moe_kernels  # noqa: E402
import multi_gpu  # noqa: E402
import rank_graphs  # noqa: E402
import report  # noqa: E402
import step_time  # noqa: E402
from comm_model import Links, Node, simulate  # noqa: E402

TINY_MOE = """
[model]
kind = "moe"
vocab_size = 256
dim = 64
n_layers = 3
n_heads = 4
n_kv_heads = 4
ffn_dim = 128
n_dense_layers = 1
num_experts = 8
top_k = 2
expert_dim = 32
[training]
seq_len = 64
param_dtype = "bfloat16"
reduce_dtype = "float32"
"""


def test_links_cost_by_group_span_and_kind():
    links = Links(intra_gbps=100.0, inter_gbps=10.0, latency_us=5.0, gpus_per_node=4, all_to_all_gbps=None, half_mb=0)
    gb = 10**9
    assert links.seconds("all_gather", gb, [0]) == 0.0
    assert links.seconds("all_gather", gb, [0, 1, 2, 3]) == pytest.approx(5e-6 + 0.75 / 100)
    assert links.seconds("reduce_scatter", gb, [0, 4]) == pytest.approx(5e-6 + 0.5 / 10)  # spans two nodes
    assert links.seconds("all_reduce", gb, [0, 1]) == pytest.approx(5e-6 + 2 * 0.5 / 100)


def test_links_bandwidth_grows_with_message_size():
    """Bus bandwidth saturates toward the peak (half of it at half_mb); all-to-alls have their own
    peak; a measured sweep replaces the formula, its latency included, for the kinds it has."""
    links = Links(intra_gbps=100.0, all_to_all_gbps=80.0, latency_us=0.0, half_mb=1.0)
    assert links.bus_gbps("all_gather", 10**6, inside=True) == pytest.approx(50.0)
    assert links.bus_gbps("all_gather", 10**9, inside=True) == pytest.approx(100.0 * 1000 / 1001)
    assert links.bus_gbps("all_to_all", 10**6, inside=True) == pytest.approx(40.0)
    small, large = (links.seconds("all_gather", n, [0, 1]) for n in (10**6, 10**8))
    assert large / small == pytest.approx(100 * 50.0 / (100.0 * 100 / 101))  # 100x the bytes, ~2x the rate
    swept = Links(latency_us=7.0, sweep={"all_to_all": [(1e6, 10.0), (1e8, 100.0)]})
    assert swept.bus_gbps("all_to_all", 10**7, inside=True) == pytest.approx(55.0)  # halfway in log(size)
    assert swept.bus_gbps("all_to_all", 10**10, inside=True) == 100.0  # constant past the last point
    assert swept.seconds("all_to_all", 10**6, [0, 1]) == pytest.approx(0.5 * 10**6 / 10e9)  # no latency added
    assert swept.seconds("all_gather", 10**6, [0, 1]) > 7e-6  # not in the sweep: the formula


def test_simulation_stalls_only_on_unfinished_collectives():
    links = Links(intra_gbps=1.0, latency_us=0.0, half_mb=0, all_to_all_gbps=None)  # 1 GB/s: an all-gather of 2 GB over 2 ranks takes 1 s
    ranks = {"g": [0, 1], "h": [0, 1]}
    flops = 1e12  # one FLOP-second per 1e12 FLOPs
    gather = lambda name, group="g": Node(name, "collective", "all_gather", group, nbytes=2 * 10**9)
    compute = lambda name, seconds: Node(name, "compute", "mm", flops=int(seconds * flops))
    wait = lambda name, of: Node(name, "wait", "wait_tensor", waits_for=of)

    exposed_first = [gather("ag"), wait("w", "ag"), compute("mm", 3.0)]
    assert simulate([exposed_first], ranks, links, flops) == dict(
        step_s=4.0, compute_s=3.0, comm_s=1.0, exposed_s=1.0, a2a_s=0.0, a2a_exposed_s=0.0
    )

    hidden = [gather("ag"), compute("mm", 3.0), wait("w", "ag")]
    assert simulate([hidden], ranks, links, flops)["exposed_s"] == 0.0

    # one stream per group: two gathers on one group run back to back, on two groups side by side
    same = [gather("a"), gather("b"), compute("mm", 0.5), wait("wa", "a"), wait("wb", "b")]
    assert simulate([same], ranks, links, flops)["step_s"] == 2.0
    apart = [gather("a"), gather("b", "h"), compute("mm", 0.5), wait("wa", "a"), wait("wb", "b")]
    assert simulate([apart], ranks, links, flops)["step_s"] == 1.0

    # a collective starts when the compute stream reaches it, and graphs run one after another
    late = [compute("mm", 2.0), gather("ag"), wait("w", "ag")]
    assert simulate([late, late], ranks, links, flops) == dict(
        step_s=6.0, compute_s=4.0, comm_s=2.0, exposed_s=2.0, a2a_s=0.0, a2a_exposed_s=0.0
    )

    # all-to-all time and its exposed part are reported on their own
    a2a = Node("a2a", "collective", "all_to_all", "h", nbytes=2 * 10**9)
    mixed = [a2a, gather("ag"), compute("mm", 0.25), wait("w1", "a2a"), wait("w2", "ag")]
    sim = simulate([mixed], ranks, links, flops)
    assert (sim["a2a_s"], sim["a2a_exposed_s"], sim["exposed_s"]) == (1.0, 0.75, 0.75)


def test_capture_costs_the_compiled_graphs_without_running_them(tmp_path):
    config = tmp_path / "tiny_moe.toml"
    config.write_text(TINY_MOE)
    graphs, ranks = comm_model.model_layout(str(config), comm_model.LAYOUTS["fsdp_ep2"], 8, 1,
                                            comm_model.SimpleFSDPPasses(), ep_chunks=2)
    assert [kind for kind, _ in graphs] == ["forward", "backward"]
    off = [n for _, g in graphs for n in g["off"]]
    on = [n for _, g in graphs for n in g["on"]]
    kinds = lambda nodes: comm_model._summary(nodes)
    # the defaults merge all-gathers and reduce-scatters per block and mesh: fewer, the same bytes
    bucketed = ("all_gather", "reduce_scatter")
    for kind in bucketed:
        assert kinds(on)[kind][0] < kinds(off)[kind][0]
        assert kinds(on)[kind][1] == pytest.approx(kinds(off)[kind][1])
    assert {k: v for k, v in kinds(on).items() if k not in bucketed} == {k: v for k, v in kinds(off).items() if k not in bucketed}
    # the passes reorder compute, never change it
    assert sorted(n.flops for n in on if n.kind == "compute") == sorted(n.flops for n in off if n.kind == "compute")
    # balanced routing, two token chunks: each dispatch sends half of the 64 tokens x top_k 2 rows of dim 64
    dispatch = [n for n in off if n.op == "all_to_all" and n.nbytes > 1024]
    assert dispatch and {n.nbytes for n in dispatch[:2]} == {32 * 2 * 64 * 2}
    # groups resolve to ranks: dense parameters on the 8 dp ranks, experts' edp and ep groups
    assert sorted(map(len, {tuple(r) for r in ranks.values()})) == [2, 4, 8]
    # traced as on a GPU (grouped_mm saves the weights, not per-row copies): backward re-gathers
    # the experts over edp, as reshard_after_forward asks
    backward = graphs[1][1]["off"]
    assert any(n.op == "all_gather" and len(ranks[n.group]) == 4 for n in backward)
    links = Links()
    assert simulate([g["on"] for _, g in graphs], ranks, links, 1e14)["exposed_s"] < \
        simulate([g["off"] for _, g in graphs], ranks, links, 1e14)["exposed_s"]


def test_layout_names_and_degrees():
    assert comm_model.LAYOUTS["fsdp_tp2_ep2"].degrees(8) == dict(dp_replicate=1, dp_shard=4, tp=2, ep=2)
    assert comm_model.LAYOUTS["fsdp_tp2_ep2"].name(8) == "FSDP4×TP2 (experts FSDP4×EP2)"
    assert comm_model.LAYOUTS["hsdp_4"].degrees(64) == dict(dp_replicate=16, dp_shard=4, tp=1, ep=1)
    assert comm_model.LAYOUTS["hsdp_4"].name(8) == "HSDP 2x4"


def _row(mode, tokens_per_s, memory, losses, ac="none"):
    return dict(model="moe", ac=ac, mode=mode, tokens_per_step=100, tokens_per_s=tokens_per_s, step_ms=1.0,
                peak_allocated_gib=memory, peak_reserved_gib=memory, mfu=0.5, compile_s=None, losses=losses)


def test_step_time_comparisons():
    rows = [_row("FSDP2 eager", 100.0, 10.0, [1.0, 2.0]),
            _row("SimpleFSDP compiled", 150.0, 8.0, [1.0, 2.0]),
            _row("SimpleFSDP compiled (no passes)", 140.0, 8.0, [1.0, 2.5]),
            _row("SimpleFSDP eager", 90.0, 9.0, [1.0, 2.0], ac="full")]  # no FSDP2 run with full AC
    step_time.add_comparisons(rows, deterministic=True)
    assert [r["ratio"] for r in rows] == [1.0, 1.5, 1.4, None]
    assert rows[1]["memory_ratio"] == 0.8
    assert rows[1]["losses_equal_no_passes"] is False
    same = rows[:2] + [_row("SimpleFSDP compiled (no passes)", 140.0, 8.0, [1.0, 2.0])]
    step_time.add_comparisons(same, deterministic=True)
    assert same[1]["losses_equal_no_passes"] is True
    fresh = [_row("SimpleFSDP compiled", 1.0, 1.0, [1.0]), _row("SimpleFSDP compiled (no passes)", 1.0, 1.0, [1.0])]
    step_time.add_comparisons(fresh, deterministic=False)  # nondeterministic kernels: no verdict
    assert "losses_equal_no_passes" not in fresh[0]
    text = step_time.markdown([dict(environment="GPU", command="cmd", warmup=1, steps=2, rows=same)])
    assert "| moe   | none | SimpleFSDP compiled " in text and "1.50" in text and "bitwise" in text


def test_step_split_times_each_phase_of_train_step():
    from simplefsdp.train.cli import train_step

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 16, (2, 4))
    with step_time.StepTimer(torch.device("cpu")) as timer:
        train_step(model, optimizer, (tokens, tokens), params=list(model.parameters()), dp_size=1, mark=timer.mark)
    assert list(timer.phases) == ["forward+backward", "clip", "optimizer"]
    assert all(t >= 0 for t in timer.phases.values()) and sum(timer.phases.values()) <= timer.seconds
    row = {**_row("SimpleFSDP compiled", 1.0, 1.0, [1.0]), "phase_ms": {"forward+backward": 120.0, "clip": 5.8, "optimizer": 13.6}}
    text = step_time.markdown([dict(environment="GPU", command="cmd", warmup=1, steps=2, rows=[row])])
    assert "| forward+backward | clip | optimizer |" in text and "| 120.0 " in text


def test_a_step_timed_after_another_counts_from_its_end():
    cpu = torch.device("cpu")
    with step_time.StepTimer(cpu) as first:
        first.mark("work")
    assert first.seconds is not None  # it waited
    time.sleep(0.05)  # the host between steps: the GPU would idle
    with step_time.StepTimer(cpu, wait=False, after=first) as second:
        second.mark("work")
    assert second.seconds is None
    second.finish()
    assert second.seconds >= 0.05 and second.phases["work"] >= 0.05
    alone = step_time.StepTimer(cpu)
    with alone:
        pass
    assert alone.seconds < 0.05


def test_live_at_peak_replays_the_allocators_events():
    here = dict(filename=__file__, line=1, name="f")
    inside_torch = dict(filename=os.path.join(step_time.TORCH_DIR, "nn", "functional.py"), line=2, name="g")
    events = [dict(action="alloc", addr=1, size=100, frames=[inside_torch, here]),
              dict(action="free_completed", addr=7, size=50),  # a block from before the first event
              dict(action="alloc", addr=2, size=30, frames=[]),
              dict(action="alloc", addr=3, size=40, frames=[here]),  # the peak: 100 + 30 + 40 - 50
              dict(action="free_requested", addr=1, size=100),
              dict(action="free_completed", addr=1, size=100),
              dict(action="alloc", addr=4, size=90, frames=[here])]  # 30 + 40 + 90 - 50 = 110 < 120
    peak, blocks = step_time.live_at_peak(events)
    assert peak == 120
    site = f"test_benchmarks.py:1: {open(__file__).readline().strip()[:120]}"
    assert sorted(blocks) == [(30, "(torch internals)", 2), (40, site, 3), (100, site, 0)]
    summary = step_time.peak_summary([(2**20 * size, where, i) for size, where, i in blocks])
    assert summary["sites"] == {site: dict(gib=140 / 2**10, blocks=2), "(torch internals)": dict(gib=30 / 2**10, blocks=1)}
    assert summary["blocks_by_mib"] == {"100.000": 1, "40.000": 1, "30.000": 1}
    assert [b["event"] for b in summary["last_allocated"]] == [0, 2, 3]
    row = {**_row("SimpleFSDP compiled", 1.0, 1.0, [1.0]),
           "memory_at_peak": dict(before_gib=1.0, step_peak_gib=0.5, events=7, **summary)}
    text = step_time.markdown([dict(environment="GPU", command="cmd", warmup=1, steps=2, rows=[row])])
    assert f"0.500 GiB more at its peak, reached at `{site}`" in text


def test_host_syncs_name_where_the_host_waited_and_restore_the_mode(monkeypatch):
    """Sync warnings are counted by the line that raised them, other warnings are not, and the
    debug mode is set back to what it was, also when the step fails."""
    import warnings

    modes = ["error"]  # a mode the caller had set
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        for _ in range(2):
            warnings.warn(f"x: {step_time.SYNC_WARNING}")  # the line the sites name
        warnings.warn("unrelated")

    line = step.__code__.co_firstlineno + 2
    site = f"test_benchmarks.py:{line}: {open(__file__).readlines()[line - 1].strip()}"
    assert step_time.host_syncs(step) == {site: 2}
    assert modes == ["error", "warn", "error"]

    def failing():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        step_time.host_syncs(failing)
    assert modes[-1] == "error"
    row = {**_row("SimpleFSDP compiled", 1.0, 1.0, [1.0]), "host_syncs": {site: 2}}
    text = step_time.markdown([dict(environment="GPU", command="cmd", warmup=1, steps=2, rows=[row])])
    assert f"| `{site}` | 2" in text


def test_rank_graphs_compare_each_graph_with_group_names_aside(tmp_path):
    """Two ranks' traces: the forward graphs differ only in a group name, the backward graphs in a
    shape too."""
    def log(rank, group, shape):
        header = 'V1208 00:00:00.000000 1 torch/_dynamo/x.py:1] {"%s": {}, "frame_id": 2, "has_payload": "ab"}\n'
        body = (f"\t\tag = torch.ops._c10d_functional.all_gather_into_tensor.default(x, 2, '{group}')\n"
                f"\t\ty: \"f32[{shape}]\" = torch.ops.aten.mm.default(ag, w)\n")
        path = tmp_path / f"dedicated_log_torch_trace_rank_{rank}_x.log"
        path.write_text(header % "aot_forward_graph" + body.replace(shape, "4") + header % "aot_backward_graph" + body
                        + 'V1208 00:00:01.000000 1 torch/_dynamo/x.py:2] {"compilation_metrics": {}}\n')
        return str(path)

    ours, theirs = rank_graphs.graphs(log(0, "1", "8")), rank_graphs.graphs(log(1, "2", "6"))
    assert list(ours) == ["aot_forward_graph", "aot_backward_graph"] and len(ours["aot_backward_graph"][0].splitlines()) == 2
    assert rank_graphs.differing_lines(ours["aot_forward_graph"][0], theirs["aot_forward_graph"][0]) == (1, 0)
    assert rank_graphs.differing_lines(ours["aot_backward_graph"][0], theirs["aot_backward_graph"][0]) == (2, 1)


def test_grouped_offsets_pad_each_group():
    counts = torch.tensor([1, 16, 0, 17])
    assert moe_kernels.offsets(counts).tolist() == [16, 32, 32, 64]
    assert moe_kernels.offsets(counts).dtype == torch.int32
    routed = moe_kernels.routed_counts(tokens=1000, experts=8, top_k=2)
    assert routed.sum() == 2000 and routed.shape == (8,)


def test_results_sections_replace_only_their_own(tmp_path):
    path = str(tmp_path / "RESULTS.md")
    report.write_section("a", "first", path)
    report.write_section("b", "second", path)
    report.write_section("a", "third", path)
    text = open(path).read()
    assert text.count("<!-- a -->") == 1 and "third" in text and "first" not in text and "second" in text
    assert report.table(["x", "long name"], [[1, 2.5], [12345.0, None]]).splitlines() == [
        "| x      | long name |", "|--------|-----------|", "| 1      | 2.5       |", "| 12,345 | –         |"]


def test_exposed_communication_is_what_no_other_kernel_covers():
    compute = [(0, 10), (12, 20), (30, 40)]
    assert step_time.exposed_time([(5, 15)], compute) == 2  # 10..12
    assert step_time.exposed_time([(5, 15), (14, 35)], compute) == 2 + 10  # merged 5..35: 10..12, 20..30
    assert step_time.exposed_time([(41, 50)], compute) == 9
    assert step_time.exposed_time([(0, 40)], [(0, 40)]) == 0
    assert step_time.exposed_time([], compute) == 0


def test_idle_gaps_count_inside_steps_and_name_the_kernels_around_them():
    # two steps begun on the host at 0 and 100; "a" overlaps "b", so 10..12 is no gap
    kernels = [(5, 12, "a"), (10, 20, "b"), (26, 40, "c"), (44, 50, "d"), (103, 110, "a"), (110, 120, "b"),
               (126, 140, "c")]
    total, gaps = step_time.idle_gaps(kernels, [100, 0])
    # 0..5 and 100..103 are step starts (50..100 is between the steps), 20..26 and 120..126 b -> c, 40..44 c -> d
    assert gaps == {"b -> c": 12, "step start -> a": 8, "c -> d": 4}
    assert total == 24
    assert list(gaps) == ["b -> c", "step start -> a", "c -> d"]  # largest first
    # a kernel that began before the first step and still runs leaves no gap; nothing before it counts
    assert step_time.idle_gaps([(-5, 3, "x"), (4, 6, "y")], [0]) == (1, {"x -> y": 1})
    assert step_time.idle_gaps(kernels, []) == (0.0, {})
    profile = dict(step_s=0.2, comm_s=0.0, copy_s=0.0, compute_s=0.19, comm_fraction=0.0, exposed_fraction=0.0,
                   idle_s=0.004, categories_s={"matmul": 0.19}, idle_gaps_s={"step start -> a": 0.003, "b -> c": 0.001})
    row = {**_row("SimpleFSDP compiled", 1.0, 1.0, [1.0]), "profile": profile}
    text = step_time.markdown([dict(environment="GPU", command="cmd", warmup=1, steps=2, rows=[row])])
    assert "GPU idle ms |" in text and "| 4.00 " in text
    assert "| `step start -> a` | 3.00 |" in text and "| `b -> c`          | 1.00 |" in text


def test_kernel_categories_from_kernel_names():
    """Names as the H200 and H100 profiles showed them fall in the category the profile table reports."""
    names = {
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer and clipping",
        "_adamw_kernel": "optimizer and clipping",
        # torch._grouped_mm's kernel on an H100 (torch 2.11), the start of its mangled name
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_"
        "17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS5_10collective13CollectiveMmaINS5_39MainloopSm90ArrayTmaGmma":
            "grouped matmul",
        "void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t>": "grouped matmul",
        "triton_tem_fused__grouped_mm_1": "grouped matmul",
        # the gathered expert weights' cast (and transpose) that Inductor fuses and names after the
        # _grouped_mm it feeds (gpu_moe on an H100: 5.1 ms a step)
        "triton_poi_fused__grouped_mm__to_copy_18": "elementwise and norm",
        "triton_poi_fused__grouped_mm__to_copy_transpose_9": "elementwise and norm",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT": "matmul",
        "triton_poi_fused_index_put_new_zeros_2": "routing and permutation",
        "_permute_rows_kernel": "routing and permutation",
        "Memcpy DtoD (Device -> Device)": "copies",
        "void at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)": "copies",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "elementwise and norm",
        "triton_per_fused_add_mean_mul_pow_rsqrt_3": "elementwise and norm",
    }
    assert {name: step_time.kernel_category(name) for name in names} == names


def test_multi_gpu_layouts_and_bus_bandwidth():
    assert multi_gpu.fitting_layouts(8) == ["fsdp", "fsdp_ep2", "fsdp_ep8", "fsdp_tp2_ep2", "hsdp_4"]
    assert multi_gpu.fitting_layouts(2) == ["fsdp", "fsdp_ep2", "fsdp_tp2_ep2"]
    assert multi_gpu.fitting_layouts(1) == []
    assert multi_gpu.bus_gbps(8 * 10**9, 1.0, 8) == 7.0
    assert comm_model.LAYOUTS["hsdp_4"].overrides(8) == [
        ("parallel.dp_replicate", "2"), ("parallel.dp_shard", "4"), ("parallel.tp", "1"), ("parallel.ep", "1"),
        ("parallel.mode", "hybrid_shard")]
