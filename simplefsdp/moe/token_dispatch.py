"""Expert parallelism: move each token to the rank that holds its expert, and back, in chunks.

The routed experts of a MoE layer are split over the ``ep`` ranks: rank ``j`` holds experts
``j*L .. (j+1)*L - 1`` (``L = num_experts / ep``). A MoE layer splits its tokens into ``chunks``
(:func:`token_chunks`) and sorts each chunk's token slots by expert (:func:`by_expert`), so the
rows for rank ``j`` are one contiguous block of it, and hands :class:`TokenDispatcher` every
chunk's rows. The dispatcher:

1. exchanges tokens-per-expert counts with one all-to-all for all chunks (``[chunks, E]`` int32
   per rank) and reads the split sizes to the host once (every rank has the same number of
   chunks, empty ones included, whatever its token count, so every rank issues the same
   collectives);
2. dispatches every chunk's rows with an autograd all-to-all whose split sizes come from the
   counts, all of them before any expert runs;
3. per chunk, in order: reorders the received rows (grouped by source rank, then expert) by
   local expert, runs the local experts, restores the order, and combines: the reverse
   all-to-all sends the outputs home.

So chunk ``i``'s experts run while chunk ``i+1``'s dispatch and chunk ``i-1``'s combine are in
flight; :mod:`simplefsdp.passes.a2a_overlap` keeps that schedule in the compiled graph, and
backward mirrors it. The token all-to-alls run on a process group of their own
(:func:`token_group`, the ep ranks again): NCCL gives it its own stream, next to FSDP's
all-gathers and reduce-scatters, and each group's collective order is checked separately.

With tensor parallelism the ep ranks include tp ranks, which hold the same tokens: each tp rank
first takes its share of a chunk's sorted rows (a local slice, no communication), dispatches only
those, and the combined rows are all-gathered over tp again.

The split sizes are read to the host (:func:`host_ints`); under torch.compile they become unbacked
symbolic sizes (``capture_scalar_outputs``, which ``simple_fsdp`` turns on when ``ep > 1``), so
dispatch and combine trace into one graph with the experts, without module state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from simplefsdp.moe.token_permute import aligned_layout
from simplefsdp.moe.token_slots import inverse_permutation, permuted_rows, repeated_rows


DEFAULT_EP_CHUNKS = 2  # token chunks per MoE layer with ep > 1 (simple_fsdp's ep_chunks)


def token_chunks(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``chunks`` contiguous, near-equal token ranges (later ones take
    the extra token), empty ones included when there are fewer tokens than chunks.

    Always ``chunks`` ranges: ranks may hold different numbers of tokens (a one-token generation
    step, an empty last batch), and every rank must send counts of one size and run as many
    all-to-alls as the others.
    """
    bounds = [tokens * i // chunks for i in range(chunks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the token slots ``experts`` (any shape) chose each expert: ``[num_experts]`` int32."""
    flat = experts.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=experts.device)
    return counts.scatter_add(0, flat, torch.ones_like(flat, dtype=torch.int32))


def by_expert(
    run: Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]],
    x: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    chunks: int,
    alignment: int = 1,
) -> torch.Tensor:
    """Every token slot's expert output, in slot order: ``[tokens * k, dim]``.

    ``x``: ``[tokens, dim]``; ``experts``: ``[tokens, k]``, the experts each token chose. The
    tokens are split into ``chunks`` (:func:`token_chunks`); each chunk's slots are sorted by
    expert (a stable sort: token order within an expert), and ``run(rows, counts)`` gets every
    chunk's sorted rows and tokens per expert at once and returns each chunk's outputs. With
    ``alignment > 1`` each expert's rows are padded with zero rows to a multiple of it
    (:func:`simplefsdp.moe.token_permute.aligned_layout`) as they are gathered, ``counts`` are
    the padded counts, and the padding rows of the outputs are left out as they go back.
    """
    top_k = experts.shape[-1]
    rows, counts, orders = [], [], []
    for start, end in token_chunks(x.shape[0], chunks):
        order = torch.argsort(experts[start:end].flatten(), stable=True)
        inverse = inverse_permutation(order)
        count = tokens_per_expert(experts[start:end], num_experts)
        if alignment > 1:  # row -> slot becomes padded row -> slot (or -1), slot -> row slot -> padded row
            count, dest, source = aligned_layout(count, order.shape[0], alignment)
            order, inverse = torch.cat([order, order.new_full((1,), -1)])[source], dest[inverse]  # [-1]: -1
        rows.append(repeated_rows(x[start:end], order, inverse, top_k))
        counts.append(count)
        orders.append((order, inverse))
    # sized by the order (static), not by the experts' rows (data-dependent after an all-to-all):
    # what follows, a compiled region's input included, keeps static shapes
    outs = [permuted_rows(out, inverse, order) for out, (order, inverse) in zip(run(rows, counts), orders)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def host_ints(t: torch.Tensor) -> list[list[int]]:
    """``t.tolist()`` of a 2-D integer tensor. Under torch.compile it reads element by element:
    Dynamo traces ``tolist`` as one ``item`` per element anyway, but through nodes that carry no
    example value, for which AOTAutograd bypasses its cache (torch 2.13: "Unsupported call_method
    target getitem"); indexing first gives the same ``item`` calls on tensor nodes."""
    if not torch.compiler.is_compiling():
        return t.tolist()  # eager: one copy to the host, not one per element
    return [[t[i, j].item() for j in range(t.shape[1])] for i in range(t.shape[0])]


def token_group(ep_mesh: DeviceMesh, ep_ranks: list[list[int]] | None) -> dist.ProcessGroup:
    """A process group of its own over ``ep_mesh``'s ranks, for the token all-to-alls.

    ``ep_ranks`` lists the ranks of every ep group of the world: every rank creates every group,
    in the same order, as ``new_group`` requires. (A DeviceMesh hands back an existing group
    where the ep dim spans the world, FSDP8 x EP8, and FSDP's gathers use that one.) Without
    that list (a mesh that is part of a larger world) the ep mesh's own group is used.
    """
    if ep_ranks is None:
        return ep_mesh.get_group()
    mine = sorted(ep_mesh.mesh.flatten().tolist())
    if mine not in [sorted(ranks) for ranks in ep_ranks]:
        raise AssertionError(f"the ep groups {ep_ranks} do not include this rank's ep ranks {mine}")
    groups = [dist.new_group(ranks) for ranks in ep_ranks]
    return groups[[sorted(ranks) for ranks in ep_ranks].index(mine)]


class TokenDispatcher:
    """Token dispatch and combine over one ``ep`` mesh dim (set on a routed-experts module).

    ``chunks``: how many token chunks a MoE layer splits its tokens into, to overlap one chunk's
    experts with another's all-to-alls. ``group``: the process group of the token all-to-alls
    (default: the ep mesh's own).
    """

    def __init__(
        self,
        ep_mesh: DeviceMesh,
        num_experts: int,
        tp_mesh: DeviceMesh | None = None,
        *,
        chunks: int = 1,
        group: dist.ProcessGroup | None = None,
    ):
        self.ep_mesh = ep_mesh
        self.tp_mesh = tp_mesh
        self.num_experts = num_experts
        self.degree = ep_mesh.size()
        self.local_experts = num_experts // self.degree
        self.chunks = chunks
        self.group = group if group is not None else ep_mesh.get_group()

    def __getstate__(self):
        """Pickled (``torch.save(model)``) with its token group by name, as a DeviceMesh keeps its
        groups: it unpickles in a process where that group exists (the same job's ranks)."""
        return {**self.__dict__, "group": self.group.group_name}

    def __setstate__(self, state):
        from torch.distributed.distributed_c10d import _resolve_process_group

        self.__dict__.update(state, group=_resolve_process_group(state["group"]))

    def _tp_share(self, x: torch.Tensor, counts: torch.Tensor):
        """This tp rank's slice of the rows (sorted by expert) and its tokens per expert."""
        experts_of_rows = torch.repeat_interleave(
            torch.arange(self.num_experts, device=x.device), counts, output_size=x.shape[0]
        )
        share = lambda t: (
            DTensor.from_local(t, self.tp_mesh, (Replicate(),), run_check=False)
            .redistribute(self.tp_mesh, (Shard(0),))
            .to_local()
        )
        mine = share(experts_of_rows)
        local_counts = torch.zeros_like(counts).scatter_add(0, mine, torch.ones_like(mine, dtype=counts.dtype))
        return share(x), local_counts

    def _tp_gather(self, out: torch.Tensor, share: int, rows: int) -> torch.Tensor:
        """All-gather the tp ranks' rows; backward keeps each rank's own slice of the gradient.

        ``out`` has the combine's data-dependent row count, which equals ``share`` (this rank's
        static row count). An index copy gives it that static size first, so DTensor's chunking
        in backward never guards on the unbacked size (torch 2.11 fails there otherwise).
        """
        out = out.index_select(0, torch.arange(share, device=out.device))
        shape = (rows, *out.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return (
            DTensor.from_local(out, self.tp_mesh, (Shard(0),), run_check=False, shape=shape, stride=stride)
            .redistribute(self.tp_mesh, (Replicate(),))
            .to_local()
        )

    def _exchange_counts(self, counts: list[torch.Tensor]):
        """One all-to-all of every chunk's tokens per expert; per chunk, the rows each local
        expert receives from each rank (``[ranks, L]``) and the send and receive split sizes."""
        ranks, experts, chunks = self.degree, self.local_experts, len(counts)
        send = torch.stack(counts).view(chunks, ranks, experts)
        # to rank j: every chunk's counts of j's experts
        recv = funcol.all_to_all_single(
            send.transpose(0, 1).reshape(-1), [chunks * experts] * ranks, [chunks * experts] * ranks, self.group
        )
        recv = funcol.wait_tensor(recv).view(ranks, chunks, experts).transpose(0, 1)
        send_splits = host_ints(send.sum(2))
        recv_splits = host_ints(recv.sum(2))
        return list(recv.unbind(0)), send_splits, recv_splits

    def __call__(
        self,
        local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        xs: list[torch.Tensor],
        counts: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """``xs[c]``: chunk c's rows sorted by expert, ``counts[c][e]`` of them for expert e;
        returns each chunk's expert outputs in its rows' order."""
        rows = [x.shape[0] for x in xs]
        if self.tp_mesh is not None:
            xs, counts = map(list, zip(*(self._tp_share(x, c) for x, c in zip(xs, counts))))
        recv_counts, send_splits, recv_splits = self._exchange_counts(counts)
        received = [
            funcol.all_to_all_single_autograd(x, recv, send, self.group)
            for x, send, recv in zip(xs, send_splits, recv_splits)
        ]
        ranks, experts = self.degree, self.local_experts
        outs = []
        for chunk, rows_in in enumerate(received):
            expert_of_row = torch.repeat_interleave(
                torch.arange(experts, device=rows_in.device).repeat(ranks),
                recv_counts[chunk].flatten(),
                output_size=rows_in.shape[0],
            )
            order = torch.argsort(expert_of_row, stable=True)
            inverse = inverse_permutation(order)
            out = local_experts(permuted_rows(rows_in, order, inverse), recv_counts[chunk].sum(0))
            out = permuted_rows(out, inverse, order)
            outs.append(funcol.all_to_all_single_autograd(out, send_splits[chunk], recv_splits[chunk], self.group))
        if self.tp_mesh is None:
            return outs
        return [self._tp_gather(out, x.shape[0], n) for out, x, n in zip(outs, xs, rows)]
