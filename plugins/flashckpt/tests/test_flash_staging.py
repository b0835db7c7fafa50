"""The staging copy's CPU paths (no CUDA here: the GPU path, pinned buffers and a side
stream, runs only under ``make gpu-check``; ``stage_cpu=True`` sends CPU tensors
through the same chunk loop with unpinned buffers and no stream)."""

from __future__ import annotations

import mmap

import pytest
import torch

from dlrover_plugin_flashckpt.staging import HostStaging


def _sources():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(37, 5, generator=g),                       # 740 bytes
            torch.randn(6, 9, generator=g, dtype=torch.float64).t(),  # not contiguous
            torch.randint(0, 100, (13,), generator=g, dtype=torch.int16),
            torch.tensor(True), torch.empty(0)]


def _shm_views(srcs):
    """Contiguous views into one anonymous mapping, as the saver's shm views are."""
    total = sum(s.numel() * s.element_size() + 8 for s in srcs)
    mm = mmap.mmap(-1, total)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    out, off = [], 0
    for s in srcs:
        n = s.numel() * s.element_size()
        out.append(buf[off:off + n].view(s.dtype).view(s.shape))
        off += -(-n // 8) * 8   # 8-byte aligned, as layout aligns them
    return mm, out


def test_cpu_sources_are_copied_directly():
    srcs = _sources()
    mm, dsts = _shm_views(srcs)
    st = HostStaging(chunk_bytes=64)
    stats = st.copy(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert stats["staged_bytes"] == 0 and stats["chunks"] == 0
    assert stats["direct_bytes"] == sum(s.numel() * s.element_size() for s in srcs)
    assert st.buffers == []   # no staging buffer without a GPU tensor
    del dsts
    mm.close()


@pytest.mark.parametrize("chunk,depth", [(64, 2), (7, 1), (4096, 3)])
def test_chunked_staging_path_is_exact(chunk, depth):
    srcs = _sources()
    mm, dsts = _shm_views(srcs)
    st = HostStaging(chunk_bytes=chunk, depth=depth, stage_cpu=True)
    stats = st.copy(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    sizes = [s.numel() * s.element_size() for s in srcs]
    assert stats["chunks"] == sum(-(-n // chunk) for n in sizes)
    assert len(st.buffers) == depth and not st.buffers[0].is_pinned()
    del dsts
    mm.close()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"chunk_bytes=0, depth=2"):
        HostStaging(chunk_bytes=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_tensors_go_through_pinned_staging():
    srcs = [s.cuda() for s in _sources()]
    srcs[0].mul_(3)   # queued on the current stream: the side stream must wait for it
    mm, dsts = _shm_views(srcs)
    st = HostStaging(chunk_bytes=256, depth=2)
    stats = st.copy(dsts, srcs)
    assert all(torch.equal(d, s.cpu()) for d, s in zip(dsts, srcs))
    assert stats["direct_bytes"] == 0 and stats["chunks"] > len(srcs)
    assert all(b.is_pinned() for b in st.buffers)
    del dsts
    mm.close()
