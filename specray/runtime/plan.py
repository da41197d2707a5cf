"""The sharding plan: conditions -> samples -> batches -> shards.

Samples are numbered 0..N-1 (``sample_id``); sample ``i`` has class
``classes[i % len(classes)]`` so every prefix of the list is class-balanced.
The list is cut into batches of ``batch_size`` FIRST and whole batches are then
grouped into shards. A batch's composition therefore depends only on the batch
size, never on the shard size or the actor count, which is what keeps images
byte-identical when either changes.

The plan is arithmetic (ranges, not lists), so the driver's memory does not
grow with the number of samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specray.spec import ArmSpec, JobSpec

if TYPE_CHECKING:  # the plan is arithmetic; torch only for the batches an actor asks for
    import torch


@dataclass(frozen=True)
class Shard:
    index: int
    num_shards: int
    start: int  # first sample_id
    stop: int  # one past the last sample_id
    batch_size: int

    @property
    def num_samples(self) -> int:
        return self.stop - self.start

    def batch_ranges(self) -> list[tuple[int, int]]:
        """(start, stop) of each batch in the shard; shard starts are batch-aligned."""
        return [(s, min(s + self.batch_size, self.stop)) for s in range(self.start, self.stop, self.batch_size)]


@dataclass(frozen=True)
class ShardTask:
    """One shard of one arm group: the unit of work an actor runs and the coordinator retries."""

    shard: Shard
    group_key: tuple[str, str, str | None]
    arms: tuple[ArmSpec, ...]  # the arms of the group still to commit, in job order

    @property
    def label(self) -> str:
        family, target, draft = self.group_key
        names = ",".join(a.name for a in self.arms)
        return f"shard {self.shard.index + 1}/{self.shard.num_shards} [{names}] ({family}: {target}/{draft})"

    @property
    def num_rows(self) -> int:
        return self.shard.num_samples * len(self.arms)


@dataclass(frozen=True)
class ShardPlan:
    num_samples: int
    batch_size: int
    shard_batches: int
    classes: tuple[int, ...]

    @classmethod
    def of(cls, spec: JobSpec) -> "ShardPlan":
        assert spec.conditions.classes is not None
        return cls(spec.num_samples, spec.batch_size, spec.shard_batches, spec.conditions.classes)

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    @property
    def num_shards(self) -> int:
        return -(-self.num_batches // self.shard_batches)

    @property
    def shard_size(self) -> int:
        return self.batch_size * self.shard_batches

    def shard(self, index: int) -> Shard:
        if not 0 <= index < self.num_shards:
            raise IndexError(f"shard {index} out of range 0..{self.num_shards - 1}")
        start = index * self.shard_size
        return Shard(index, self.num_shards, start, min(start + self.shard_size, self.num_samples), self.batch_size)

    def iter_shards(self) -> Iterator[Shard]:
        """Every shard in order, one at a time (the plan never holds them all)."""
        return (self.shard(k) for k in range(self.num_shards))

    def shards(self) -> list[Shard]:
        return list(self.iter_shards())

    def labels(self, sample_ids: "torch.Tensor") -> "torch.Tensor":
        import torch

        classes = torch.tensor(self.classes, dtype=torch.int64)
        return classes[sample_ids % len(self.classes)]

    def batch(self, start: int, stop: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(sample_ids, labels) of the samples start..stop-1, int64 [B]."""
        import torch

        sample_ids = torch.arange(start, stop, dtype=torch.int64)
        return sample_ids, self.labels(sample_ids)

    def layout(self) -> dict[str, int]:
        return {"num_samples": self.num_samples, "batch_size": self.batch_size,
                "shard_batches": self.shard_batches, "num_shards": self.num_shards}


SAMPLES_DIR = "samples"


def shard_relpath(arm: str, index: int, num_shards: int) -> str:
    """Deterministic name of an (arm, shard) file, relative to the run's output.

    The folder is the bare arm name, not a hive-style ``arm=<arm>``: every row already holds its
    ``arm`` column, and a directory key of the same name makes pandas and ``pq.read_table`` refuse
    ``samples/`` (a string column against a dictionary-typed partition key). Arm names never hold
    ``=``, so no reader takes these folders for partition keys.
    """
    width = max(5, len(str(num_shards)))
    return f"{SAMPLES_DIR}/{arm}/shard-{index:0{width}d}-of-{num_shards:0{width}d}.parquet"
