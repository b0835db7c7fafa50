"""The flash saver's ``checkpoint.dir`` as a URI: ``file:///path`` is that path (an
NFS-like mount); other fsspec URIs are refused with an error naming the key, since the
persisters commit by rename and O_EXCL locks on a file system every node mounts."""

from __future__ import annotations

import pytest

from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
from dlrover_core.spec.errors import SpecError
from dlrover_plugin_flashckpt.saver import FlashSaver


def test_file_uri_is_the_local_path(tmp_path):
    saver = FlashSaver(SaverConfig(dir=f"file://{tmp_path}/ck", keep=1, job="flash-uri"),
                       SaverContext())
    try:
        assert saver.dir == f"{tmp_path}/ck"
    finally:
        saver.close()


@pytest.mark.parametrize("uri", ["memory://bucket/ck", "s3://bucket/ck", "file://host/ck"])
def test_other_uris_are_refused_naming_the_key(uri):
    with pytest.raises(SpecError) as e:
        FlashSaver(SaverConfig(dir=uri, keep=1, job="flash-uri"), SaverContext())
    assert e.value.key == "checkpoint.dir" and e.value.value == uri
    assert "file:///path" in str(e.value)
