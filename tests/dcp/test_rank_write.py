"""One rank's write (``dcp/rank_write.py``) and reuse's probe share one encoding through the ``BlockSink`` contract
(``format/integrity.py``): a sink gets each stored block once, in order, so the probe compares exactly the digests a
data file records, and stops at the first block that differs."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dcp_atomic.dcp.rank_write import RankWrite, StoredForm
from dcp_atomic.dcp.reuse import ReuseContext, _Changed, _Probe
from dcp_atomic.format.codec import Encoder
from dcp_atomic.format.integrity import HashingWriter, block_digest
from dcp_atomic.format.layout import RunLayout, new_save_id
from dcp_atomic.stores.storage import LocalStorage

BLOCK = 1024


class _Resolves:
    """A planner whose ``resolve_data`` hands back the tensor it was given, as DefaultSavePlanner does."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return self.tensor


class _Blocks:
    """A sink that only records what it receives."""

    def __init__(self) -> None:
        self.position = 0
        self.blocks: list[bytes] = []

    def write_unhashed(self, block) -> None:
        self.blocks.append(bytes(block))
        self.position += len(self.blocks[-1])


def _rank_write(tmp_path, tensor: torch.Tensor) -> tuple[RankWrite, WriteItem]:
    storage = LocalStorage(str(tmp_path))
    ctx = ReuseContext(rank=0, layout=RunLayout(storage, "run"), storage=storage, step=1, save_id=new_save_id(),
                       data_prefixes=0, threads=1)
    item = WriteItem(index=MetadataIndex("w", torch.Size([0])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), tensor.shape),
                                                 TensorProperties(dtype=tensor.dtype), tensor.shape))
    return RankWrite(ctx, _Resolves(tensor), StoredForm(BLOCK, chunk_sizes=True)), item


def test_a_sink_gets_each_stored_block_once_in_order_and_the_probe_accepts_exactly_the_written_ones(tmp_path):
    tensor = torch.arange(700, dtype=torch.float32)  # 2800 bytes: two whole blocks and a part
    write, item = _rank_write(tmp_path, tensor)
    data = io.BytesIO()
    written = write.encode_item(HashingWriter(data, BLOCK), item, Encoder("none"))

    sink = _Blocks()
    assert write.encode_item(sink, item, Encoder("none")) == written
    assert [len(b) for b in sink.blocks] == [BLOCK, BLOCK, 2800 - 2 * BLOCK]
    assert b"".join(sink.blocks) == data.getvalue() == tensor.numpy().tobytes()
    assert written.checksums == [block_digest(b) for b in sink.blocks]

    probe = _Probe(written.checksums)
    assert write.encode_item(probe, item, Encoder("none")) == written
    assert probe.position == written.length

    tensor[-1] += 1  # the last block differs
    probe = _Probe(written.checksums)
    with pytest.raises(_Changed):
        write.encode_item(probe, item, Encoder("none"))
    assert probe.position == 2 * BLOCK  # the blocks before it were compared, nothing after
