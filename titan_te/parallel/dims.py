"""The parallel dimensions of a run, and the one device mesh they make.

Every dimension is a (name, size) pair, outermost first; today the data-parallel ones, `dp_replicate`
(HSDP's replicas) and `dp_shard` (FSDP's shards). The mesh is built from all of them at once, and everything
that depends on the layout asks this object: the data-parallel rank and size (which batch a rank reads, the
checkpoint's per-rank parts, tokens per rank), the sub-mesh a parallelism applies to. A new dimension
(tensor or context parallel) adds its pair in `from_config` and the code that uses its sub-mesh.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DATA_PARALLEL = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    dims: tuple[tuple[str, int], ...]  # (name, size), outermost first; the sizes multiply to the world size

    @classmethod
    def from_config(cls, pcfg, world: int) -> "ParallelDims":
        from titan_te.config import dp_degrees

        replicate, shard = dp_degrees(pcfg, world)
        return cls((("dp_replicate", replicate), ("dp_shard", shard)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def world(self) -> int:
        return math.prod(s for _, s in self.dims)

    def size(self, name: str) -> int:
        return dict(self.dims)[name]

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global rank `rank` sits on each dimension (row-major, as init_device_mesh lays ranks out)."""
        out = {}
        for name, size in reversed(self.dims):
            out[name], rank = rank % size, rank // size
        return out

    @property
    def dp_world(self) -> int:
        """Ranks that read different data: the product of the data-parallel dimensions."""
        return math.prod(s for n, s in self.dims if n in DATA_PARALLEL)

    def dp_rank(self, rank: int) -> int:
        """Which slice of the global batch global rank `rank` reads (its place among the data-parallel dims)."""
        at, out = self.coordinates(rank), 0
        for name, size in self.dims:
            if name in DATA_PARALLEL:
                out = out * size + at[name]
        return out

    def build_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(s for _, s in self.dims), mesh_dim_names=self.names)
