"""HSDP (hybrid sharded data parallel) through Accelerate's ParallelismConfig: a 2-D (dp_replicate, dp_shard) mesh.

Accelerate's prepare() calls fully_shard(module, mesh=mesh["dp_replicate", "dp_shard_cp"]) on it: each block's
parameters, gradients and optimizer state are sharded over the dp_shard processes of a group (the GPUs of one node)
and replicated across the dp_replicate groups (the nodes); gradients are reduce-scattered inside a group and then
all-reduced across the groups. Ranks are laid out replicate-major (rank = replica * dp_shard + shard), so with
dp_shard = GPUs per node a group is one node and the per-step all-gathers never leave it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

from ..core import rules
from ..core.launch import has_accelerator
from ..core.rules import Rule, Run
from .fsdp_launch import force_fsdp_on_cpu


@dataclass
class GlooParallelismConfig(ParallelismConfig):
    """ParallelismConfig for a CPU-only machine (gloo): FSDP2 forced before Accelerate validates the config.

    Why: Accelerator(...) validates its parallelism_config right after building the state, and refuses any
    distributed type but FSDP2 / MULTI_GPU-like / DeepSpeed; without GPUs the state is never FSDP (the same gap
    shared/techniques/fsdp_launch.py closes for plain FSDP2, there after the constructor, too late here). Forcing
    FSDP2 first leaves the rest as Accelerate does it on GPUs: the mesh (init_device_mesh("cpu") over the gloo
    group), its validation, and fully_shard on the 2-D mesh in prepare(). Accelerate 1.15, torch 2.13.
    """

    fsdp_plugin: FullyShardedDataParallelPlugin | None = None

    def _validate_accelerator(self, accelerator: Accelerator) -> None:
        force_fsdp_on_cpu(accelerator, self.fsdp_plugin)
        super()._validate_accelerator(accelerator)


def hsdp_sizes(run: rules.Run) -> tuple[int, int]:
    """(replicas, processes per replica) from --dp_replicate_size / --dp_shard_size (0: unset), the missing one being
    the processes divided by the other; the rule table has already refused sizes that do not fill the processes."""
    replicate, shard, world = run.dp_replicate_size, run.dp_shard_size, run.num_processes
    if replicate and shard:
        return replicate, shard
    if shard:
        return world // shard, shard
    return replicate or 1, world // (replicate or 1)


def parallelism_config(run: rules.Run, fsdp_plugin: FullyShardedDataParallelPlugin) -> ParallelismConfig | None:
    """Accelerate's ParallelismConfig(dp_replicate_size, dp_shard_size), on a CPU-only machine the subclass above;
    None when neither flag was given (Accelerate's FSDP2 over all processes, or the launch config's own)."""
    if not (run.dp_replicate_size or run.dp_shard_size):
        return None
    replicate, shard = hsdp_sizes(run)
    if has_accelerator():
        return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)
    return GlooParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, fsdp_plugin=fsdp_plugin)


def hsdp_report(accelerator: Accelerator, model: torch.nn.Module, optimizer: object) -> dict[str, object]:
    """results.json fields of a run with a ParallelismConfig (none otherwise): the sizes, the mesh's ranks as
    [replica][shard], and per process its [replica, shard] coordinates and shard_digest (a collective)."""
    config, mesh = accelerator.parallelism_config, accelerator.torch_device_mesh
    if config is None or mesh is None:
        return {}
    from accelerate.utils import gather_object

    dims = [d for d in ("dp_replicate", "dp_shard") if d in mesh.mesh_dim_names]  # a size-1 dimension is left out
    here = [mesh.get_local_rank(d) if d in dims else 0 for d in ("dp_replicate", "dp_shard")]
    ranks = mesh[tuple(dims)].mesh.reshape(config.dp_replicate_size, config.dp_shard_size)
    return {"dp_replicate_size": config.dp_replicate_size, "dp_shard_size": config.dp_shard_size,
            "mesh": ranks.tolist(), "mesh_coordinates": gather_object([here]),
            "shard_digest": gather_object([shard_digest(model, optimizer)])}


def shard_digest(model: torch.nn.Module, optimizer: object) -> str:
    """SHA-256 of this process's local shards, the parameters and their AdamW state (step, moments) in order: two
    processes with the same shard index hold the same bytes exactly when their digests are equal."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps torch's AdamW
    for p in model.parameters():
        state = inner.state.get(p, {})
        for t in (p, *(state[k] for k in sorted(state))):
            local = t.to_local() if isinstance(t, DTensor) else t
            digest.update(local.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _hsdp(r: Run) -> str:  # the HSDP flags given, as typed ("": none)
    return " ".join(f"--{k} {v}" for k, v in (("dp_replicate_size", r.dp_replicate_size),
                                              ("dp_shard_size", r.dp_shard_size)) if v)


def _hsdp_sizes(r: Run) -> tuple[float, float]:  # (replicas, processes per replica); unset: n over the other
    n, replicas, shard = r.num_processes, r.dp_replicate_size, r.dp_shard_size
    return replicas or n / shard, shard or n / replicas


def _hsdp_fills(r: Run) -> bool:
    replicas, shard = _hsdp_sizes(r)
    return replicas * shard == r.num_processes and replicas % 1 == shard % 1 == 0


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # HSDP (recipes/fsdp.py --dp_replicate_size / --dp_shard_size; under ZeRO: the rule on launches above).
    Rule(lambda r: bool(_hsdp(r)) and not _hsdp_fills(r),
         lambda r: f"{_hsdp(r)} with {'one process' if r.num_processes == 1 else f'{r.num_processes} processes'}: "
                   "the dp_replicate x dp_shard mesh must hold every process once",
         lambda r: "launch R x S processes: accelerate_configs/hsdp.yaml (4, --dp_replicate_size 2)"
         if r.num_processes == 1 else f"pass sizes whose product is {r.num_processes}, or one, a divisor of it "
                                      "(e.g. --dp_replicate_size 2 on 4; nodes: --dp_shard_size = GPUs per node)"),
    Rule(lambda r: bool(_hsdp(r)) and r.num_processes > 1 and _hsdp_fills(r) and _hsdp_sizes(r)[1] == 1,
         lambda r: f"{_hsdp(r)} with {r.num_processes} processes makes each replica one process: plain data "
                   "parallel, nothing for FSDP2 to shard (Accelerate refuses dp_shard_size 1 under FSDP)",
         lambda r: "use fewer replicas (--dp_shard_size 2 or more), or recipes/data_parallel.py for DDP"),
)
rules.register(*RULES, fields=dict(dp_replicate_size=0, dp_shard_size=0))
