"""The Python Data Source (Spark 4) behind :func:`~sqla_delayedq.spark.read_queue`.

Spark creates the source from string options; ours carry one, ``plan``: the pickled
:class:`ReadTask` (connection spec without secrets, what to select, the id ranges), which
``read_queue`` prepares on the driver. Each id range is one input partition; its task reads
with its own connection and yields Arrow record batches, so no JVM driver jar is needed.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from ._common import ConnectSpec, ReadPlan

NAME = "sqla_delayedq"


@dataclass(frozen=True)
class ReadTask:
    spec: ConnectSpec
    plan: ReadPlan
    ranges: tuple[tuple[int | None, int | None], ...]
    ddl: str

    def encode(self) -> str:
        from pyspark import cloudpickle

        return base64.b64encode(cloudpickle.dumps(self)).decode("ascii")  # type: ignore[no-untyped-call]

    @staticmethod
    def decode(text: str) -> ReadTask:
        import pickle

        task = pickle.loads(base64.b64decode(text))
        assert isinstance(task, ReadTask)
        return task


class IdRange(InputPartition):
    """Ids ``lo <= id < hi`` of the message table; ``None`` is no bound."""

    def __init__(self, lo: int | None, hi: int | None) -> None:
        super().__init__((lo, hi))
        self.lo = lo
        self.hi = hi


class QueueDataSource(DataSource):
    """``spark.read.format("sqla_delayedq")``; build it with ``read_queue``, not by hand."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def _task(self) -> ReadTask:
        text = self.options.get("plan")
        if not text:
            raise ValueError("use sqla_delayedq.spark.read_queue() to read a queue")
        return ReadTask.decode(text)

    def schema(self) -> str:
        return self._task().ddl

    def reader(self, schema: StructType) -> QueueReader:
        return QueueReader(self._task(), schema)


class QueueReader(DataSourceReader):
    def __init__(self, task: ReadTask, schema: StructType) -> None:
        self.task = task
        self.struct = schema

    def partitions(self) -> list[IdRange]:
        return [IdRange(lo, hi) for lo, hi in self.task.ranges]

    def read(self, partition: Any) -> Iterator[Any]:
        from pyspark.sql.pandas.types import to_arrow_schema

        schema = to_arrow_schema(self.struct, timezone="UTC")
        spec, plan = self.task.spec, self.task.plan
        if spec.is_postgresql:
            from . import _pg

            return _pg.read_range(spec, plan, partition.lo, partition.hi, schema)
        from . import _generic

        return _generic.read_range(spec, plan, partition.lo, partition.hi, schema)
