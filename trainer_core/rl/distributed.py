"""Data-parallel plumbing for `train_on_batch`: joining the process group, sharing out the
batch, and the collectives and pieces that the data-parallel strategies share (`FSDP2Strategy` in
`rl.fsdp2`, `DeepSpeedStrategy` in `rl.zero`; `rl.strategies.build_strategy` builds one by name).

Every rank runs `train_on_batch` on its own share of the batch (`shard_samples`: whole GRPO
groups, as many samples on each rank), with the strategy built over the same policy weights on
every rank. The strategy averages gradients over ranks; `train_on_batch` has already weighted
each rank's loss so that the average is the gradient of the whole batch's loss, as one process
would compute it.

Launch one process per device with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; `init_distributed` joins the process group they describe (gloo on
CPU, NCCL on GPU):

    torchrun --nproc_per_node=2 train.py

    env = init_distributed()
    strategy = build_strategy("fsdp2", policy.model, cfg, value_head=value_head)
    metrics = train_on_batch(policy.model, shard_samples(batch, env.rank, env.world_size), cfg,
                             strategy, value_head=value_head)

`train_on_batch` calls the policy's inner model and its LM head itself, rather than the causal
LM's own forward, so each strategy wraps the policy in a `ForwardRunner` root module whose
forward runs whatever pass `train_on_batch` hands to `Strategy.forward`: FSDP2 gathers the
parameters of its root (embeddings, final norm, LM head, tied or not) in the root's forward,
and DeepSpeed's engine does its per-micro-batch bookkeeping in its own. Collectives happen inside
those passes (FSDP2 per unit, ZeRO-3 per module call), so every rank must make the same calls:
`train_on_batch` gives every rank as many micro-batches and LM-head chunks as the busiest one.

A PPO value head (`Linear(hidden, 1)`) is replicated on every rank by both strategies
(`ReplicatedCritic`): its gradients are averaged with one all-reduce, clipped apart from the
actor's (as `LocalStrategy` does), and stepped by a torch AdamW.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from contracts.samples import Sample
from trainer_core.rl.strategy import ADAM_BETAS, ADAM_EPS

_T = TypeVar("_T")

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the data-parallel group."""

    rank: int
    world_size: int
    local_rank: int  # index of this process on its machine: which GPU it drives
    device: torch.device


def init_distributed(backend: str | None = None) -> DistEnv:
    """Join the default process group described by torchrun's environment variables.

    The backend is NCCL when CUDA is available (this process then drives GPU LOCAL_RANK), else
    gloo; `backend` overrides it. Joining twice is harmless: an existing group is kept.
    """
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: start this process with torchrun "
            "(python -m torch.distributed.run --nproc_per_node=N ...), or set all of "
            f"{', '.join(_TORCHRUN_VARS)}"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        # MASTER_ADDR and MASTER_PORT are read by the default env:// rendezvous.
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None
        )
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def exit_rank(code: int = 0) -> NoReturn:
    """End this rank's process now: close the process group (NCCL then frees its communicators),
    flush logs and stdio, and skip the interpreter's finalization.

    A gloo rank that exits normally can abort ("terminate called without an active exception",
    SIGABRT): a worker thread of the process group drops the last reference to a finished
    collective's tensors while the interpreter is being torn down, and freeing them needs the
    GIL, which a finalizing interpreter refuses by ending the thread (pytorch/pytorch#179291;
    `destroy_process_group` alone does not prevent it while a device mesh still holds the group).
    The 2-rank tests hit it about once in 20 launches; the one caught with a Python stack was
    past the end of the rank's work. Call this once everything the rank writes is durable.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard_samples(samples: Sequence[Sample], rank: int, world_size: int) -> list[Sample]:
    """Rank `rank`'s share of `samples`: whole groups (a GRPO baseline is its group's mean, so a
    group must not be split across ranks), consecutive in order of first appearance, and as many
    samples on every rank (each rank then takes the same number of optimizer steps).

    With 4 groups of 2 samples on 2 ranks, rank 0 gets the first two groups and rank 1 the
    last two. Raises ValueError when the groups cannot be shared out evenly that way.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    if len(samples) % world_size:
        raise ValueError(f"{len(samples)} samples do not divide evenly over {world_size} ranks")
    per_rank = len(samples) // world_size
    shares: list[list[Sample]] = [[]]
    for group in groups.values():
        if len(shares[-1]) == per_rank:
            shares.append([])
        shares[-1].extend(group)
        if len(shares[-1]) > per_rank:
            raise ValueError(
                f"groups of sizes {[len(g) for g in groups.values()]} cannot be shared out "
                f"{per_rank} samples per rank without splitting a group"
            )
    return shares[rank]


class ForwardRunner(nn.Module):
    """Root module around the policy whose forward is a callable: `train_on_batch`'s forward
    passes call the policy's submodules directly, and run inside this module's forward so the
    wrapping (FSDP2's root hooks, DeepSpeed's engine) sees each of them."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, fn: Callable[[], _T]) -> _T:
        return fn()


def all_reduce(value: Tensor, op: str, device: torch.device) -> Tensor:
    """`value` reduced over the ranks with "sum", "max" or "min" (a new tensor)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    # The tensor travels on the backend's device (NCCL reduces GPU tensors only) and comes back
    # on its own; `copy=True` keeps the caller's tensor untouched.
    reduced = value.detach().to(device, copy=True)
    dist.all_reduce(reduced, op=ops[op])
    return reduced.to(value.device)


class ReplicatedCritic:
    """A small critic (the PPO value head) kept whole on every rank: gradients averaged with one
    all-reduce, clipped on their own, stepped by a torch AdamW."""

    def __init__(self, critic: nn.Module, lr: float, max_grad_norm: float) -> None:
        self._params = list(critic.parameters())
        with torch.no_grad():  # every rank starts from rank 0's weights
            for p in self._params:
                dist.broadcast(p.data, src=0)
        self._max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)

    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all of them
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(self._params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = g.view_as(p)
        nn.utils.clip_grad_norm_(self._params, self._max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def broadcast_object(obj: _T | None) -> _T:
    """Rank 0's `obj` on every rank (pickled; what other ranks pass is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_whole(
    weights: dict[str, Tensor],
    params: dict[str, nn.Parameter],
    rank: int,
    device: torch.device,
    shape_of: Callable[[nn.Parameter], torch.Size] = lambda p: p.shape,
) -> Iterator[tuple[nn.Parameter, Tensor]]:
    """Rank 0's `weights` (whole parameters by name, all or some) on every rank, one at a time:
    each of `params` named there, with its whole tensor broadcast from rank 0 in the parameter's
    dtype and `shape_of` it (a collective: the other ranks may pass {})."""
    names = broadcast_object(list(weights) if rank == 0 else None)
    unknown = sorted(set(names) - params.keys())
    if unknown:
        raise KeyError(f"weights the policy does not have: {unknown[:5]}")
    for name in names:
        param = params[name]
        if rank == 0:
            whole = weights[name].to(device, param.dtype, copy=True)
        else:
            whole = torch.empty(shape_of(param), dtype=param.dtype, device=device)
        dist.broadcast(whole, src=0)
        yield param, whole
