"""Expert parallelism: move each token to the rank that holds its expert, and back.

The routed experts of a MoE layer are split over the ``ep`` ranks: rank ``j`` holds experts
``j*L .. (j+1)*L - 1`` (``L = num_experts / ep``). Tokens arrive sorted by expert, so the tokens
for rank ``j`` are one contiguous block. :class:`TokenDispatcher`:

1. exchanges tokens-per-expert counts with an all-to-all (``[E]`` int32 per rank);
2. dispatches the token rows with an autograd all-to-all whose split sizes come from the counts;
3. reorders the received rows (grouped by source rank, then expert) by local expert, runs the
   local experts, restores the order;
4. combines: the reverse all-to-all sends the outputs home.

With tensor parallelism the ep ranks include tp ranks, which hold the same tokens: each tp rank
first takes its share of the sorted rows (a local slice, no communication), dispatches only
those, and the combined rows are all-gathered over tp again.

The split sizes are read to the host (``tolist``); under torch.compile they become unbacked
symbolic sizes (``capture_scalar_outputs``, which ``simple_fsdp`` turns on when ``ep > 1``), so
dispatch and combine trace into one graph with the experts, without module state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def is_routed_experts(module: torch.nn.Module) -> bool:
    """Routed-expert modules declare ``num_experts`` and an ``expert_parallel`` slot."""
    return hasattr(module, "num_experts") and hasattr(module, "expert_parallel")


class TokenDispatcher:
    """Token dispatch and combine over one ``ep`` mesh dim (set on a routed-experts module)."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int, tp_mesh: DeviceMesh | None = None):
        self.ep_mesh = ep_mesh
        self.tp_mesh = tp_mesh
        self.num_experts = num_experts
        self.degree = ep_mesh.size()
        self.local_experts = num_experts // self.degree

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

    def __call__(
        self,
        local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        rows = x.shape[0]
        if self.tp_mesh is not None:
            x, counts = self._tp_share(x, counts)
        ranks, experts = self.degree, self.local_experts
        group = self.ep_mesh.get_group()
        # recv_counts[i, e]: rows that rank i sends to local expert e here
        recv_counts = funcol.all_to_all_single(counts, [experts] * ranks, [experts] * ranks, group)
        recv_counts = funcol.wait_tensor(recv_counts).view(ranks, experts)
        send_splits = counts.view(ranks, experts).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = funcol.all_to_all_single_autograd(x, recv_splits, send_splits, group)

        expert_of_row = torch.repeat_interleave(
            torch.arange(experts, device=x.device).repeat(ranks),
            recv_counts.flatten(),
            output_size=received.shape[0],
        )
        order = torch.argsort(expert_of_row, stable=True)
        out = local_experts(received[order], recv_counts.sum(0))
        out = torch.empty_like(out).index_copy(0, order, out)
        out = funcol.all_to_all_single_autograd(out, send_splits, recv_splits, group)
        return out if self.tp_mesh is None else self._tp_gather(out, x.shape[0], rows)
