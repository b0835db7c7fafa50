"""Columnar chunks (:mod:`dlrover_plugin_odl.columns`) and the preprocess role's use of
them, in this process: what the source puts into the object store and what a
preprocess worker makes of it, with a columnar and a row-wise ``transform``."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from dlrover_plugin_odl import ledger
from dlrover_plugin_odl.columns import to_columns, to_records
from dlrover_plugin_odl.toy import toy_records
from dlrover_plugin_odl.workloads import PreprocessWorkload

from dlrover_core.runtime.context import WorkerContext


def test_numeric_fields_become_arrays_and_the_rest_stays_lists():
    recs = [{"id": i, "x": [float(i), 2.0, 3.0], "y": i % 2, "tag": f"t{i}", "ok": True}
            for i in range(4)]
    recs.append({"id": 4, "x": [1, 2, 3], "y": 1, "tag": "t4", "ok": False, "late": 7})
    cols = to_columns(recs)
    assert list(cols) == ["id", "x", "y", "tag", "ok", "late"]
    assert cols["id"].dtype == np.int64 and cols["id"].tolist() == [0, 1, 2, 3, 4]
    assert cols["x"].dtype == np.float64 and cols["x"].shape == (5, 3)
    assert cols["x"][4].tolist() == [1.0, 2.0, 3.0]
    assert cols["y"].dtype == np.int64
    assert cols["tag"] == ["t0", "t1", "t2", "t3", "t4"]
    assert cols["ok"] == [True, True, True, True, False]        # booleans are not numbers
    assert cols["late"] == [None, None, None, None, 7]          # not in every record
    back = to_records(cols, 5)
    assert back[0] == {"id": 0, "x": [0.0, 2.0, 3.0], "y": 0, "tag": "t0", "ok": True}
    assert back[4]["late"] == 7 and "late" not in back[3]


def test_ragged_and_mixed_fields_stay_lists_and_a_non_dict_record_is_refused():
    assert to_columns([{"x": [1.0, 2.0]}, {"x": [1.0]}])["x"] == [[1.0, 2.0], [1.0]]
    assert to_columns([{"v": 1}, {"v": "a"}])["v"] == [1, "a"]
    assert to_columns([{"v": 1}, {"v": None}])["v"] == [1, None]
    assert to_columns([]) == {}
    with pytest.raises(TypeError, match="must be a dict, not list"):
        to_columns([{"x": 1}, [1, 2]])


def test_a_columnar_chunk_pickles_its_arrays_out_of_band():
    """What makes the columns cheaper than rows in the object store: with pickle
    protocol 5 (what Ray uses) the 2,048 ids, records of 9 floats and labels leave the
    pickle as three whole buffers, which Ray's reader maps without copying, and what
    is pickled in-band is a few hundred bytes, not 2,048 dicts."""
    rows = [{"id": i, "x": [float(i + k) for k in range(9)], "y": i % 2} for i in range(2048)]
    cols = to_columns(rows)
    buffers: list = []
    blob = pickle.dumps(cols, protocol=5, buffer_callback=buffers.append)
    assert len(blob) < 1024
    assert sorted(b.raw().nbytes for b in buffers) == [2048 * 8, 2048 * 8, 2048 * 9 * 8]
    back = pickle.loads(blob, buffers=buffers)
    assert np.array_equal(back["x"], np.array([r["x"] for r in rows]))


def preprocess(cls=PreprocessWorkload):
    """A preprocess workload built with its context, outside an actor (``process``
    reads nothing else)."""
    return cls(WorkerContext(job="t", role="preprocess", rank=0, world_size=1, local_rank=0,
                             local_world_size=1))


def chunk_of(records, key="0", first=100):
    positions = list(range(first, first + len(records)))
    return {"partition": 0, "key": key, "positions": positions, "n": len(records),
            "columns": to_columns(records)}


class RowWise(PreprocessWorkload):
    """A preprocess written against the row-wise API: x doubled."""

    def transform(self, records):
        return {"x": torch.tensor([[2 * v for v in r["x"]] for r in records]),
                "y": torch.tensor([r["y"] for r in records])}


def test_process_builds_the_same_batch_from_columns_as_the_row_wise_default():
    records = list(toy_records(50))
    out = preprocess().process(chunk_of(records))
    rows = preprocess().transform(records)
    assert out["n"] == 50
    assert out["batch"]["x"].dtype == torch.float32 and out["batch"]["y"].dtype == torch.int64
    assert torch.equal(out["batch"]["x"], rows["x"]) and torch.equal(out["batch"]["y"], rows["y"])
    assert out["ids"] == [ledger.record_id(r, "0", 100 + i) for i, r in enumerate(records)]


def test_a_row_wise_transform_override_still_gets_records():
    records = list(toy_records(8))
    out = preprocess(RowWise).process(chunk_of(records))
    assert torch.equal(out["batch"]["x"], torch.tensor([[2 * v for v in r["x"]]
                                                        for r in records]))


def test_records_without_ids_get_key_at_position_ids():
    records = [{"x": [1.0], "y": 0}, {"x": [2.0], "y": 1, "id": "b"}]
    out = preprocess().process(chunk_of(records, key="3", first=7))
    assert out["ids"] == ["3@7", "b"]
    no_ids = preprocess().process(chunk_of([{"x": [1.0], "y": 0}], key="2", first=9))
    assert no_ids["ids"] == ["2@9"]
