"""The record ledger (``dlrover_plugin_odl.ledger``) on real log files: what counts as
lost and duplicated, when the stream ended and when the job stopped before it."""

from __future__ import annotations

from dlrover_plugin_odl import ledger


def _hand_out(job_dir, key, positions, ids=None):
    log = ledger.open_log(str(job_dir), ledger.HANDED_OUT, key)
    ledger.write_handed_out(log, positions, ids or [str(p) for p in positions])
    log.close()


def _train(job_dir, rank, ids, step=None, restored=None):
    log = ledger.open_log(str(job_dir), ledger.TRAINED, rank)
    if restored is not None:
        ledger.write_restored(log, restored)
    ledger.write_trained(log, ids, step)
    log.close()


def test_every_record_handed_out_is_due_when_the_stream_ended(tmp_path):
    _hand_out(tmp_path, 0, [0, 2, 4, 6])
    _hand_out(tmp_path, 1, [1, 3, 5, 7])
    _train(tmp_path, 0, ["0", "2", "4", "6", "1", "3", "7"])   # 5 never trained
    tally = ledger.count(str(tmp_path), {"0": 6, "1": 7}, ended=True)
    assert tally == {"lost": 1.0, "duplicated": 0.0, "retrained": 0.0, "handed_out": 8.0,
                     "trained": 7.0}


def test_a_trainer_restart_re_reads_from_its_offset_and_duplicates_what_it_retrains(
        tmp_path):
    _hand_out(tmp_path, 0, [0, 1, 2, 3])
    _train(tmp_path, 0, ["0", "1", "2", "3"])   # checkpoint at offset 1, then killed
    _hand_out(tmp_path, 0, [2, 3, 4, 5])         # the source seeks back to 1
    _train(tmp_path, 0, ["2", "3", "4", "5"])
    tally = ledger.count(str(tmp_path), {"0": 5}, ended=True)
    assert tally["lost"] == 0.0 and tally["duplicated"] == 2.0
    assert tally["handed_out"] == 6.0   # re-handed-out records count once


def test_what_a_restored_trainer_retrains_replaces_what_the_lost_model_trained(tmp_path):
    """The trainer's log says from which step each entry was trained and from which
    step each (re)start began: entries at or after a restore's step were trained by the
    model a restart threw away; they count as ``retrained``, not as trained."""
    _hand_out(tmp_path, 0, [0, 1, 2, 3])
    _train(tmp_path, 0, ["0", "1"], step=0, restored=0)
    _train(tmp_path, 0, ["2", "3"], step=1)      # then killed; the checkpoint is step 1
    _hand_out(tmp_path, 0, [2, 3, 4, 5])         # the source seeks back to offset 1
    _train(tmp_path, 0, ["2", "3"], step=1, restored=1)
    _train(tmp_path, 0, ["4", "5"], step=2)
    tally = ledger.count(str(tmp_path), {"0": 5}, ended=True)
    assert tally == {"lost": 0.0, "duplicated": 0.0, "retrained": 2.0, "handed_out": 6.0,
                     "trained": 6.0}
    assert ledger.trained_ids(str(tmp_path)) == {str(i): 1 for i in range(6)}
    # a restore to step 0 (no checkpoint yet) drops everything trained before it
    _train(tmp_path, 1, ["9"], step=0, restored=0)
    _train(tmp_path, 1, [], step=0, restored=0)
    assert ledger.count(str(tmp_path), {"0": 5}, ended=True)["retrained"] == 3.0


def test_a_stopped_job_leaves_read_ahead_records_undue(tmp_path):
    # handed out 0..7 in two reads, trained up to 3 (the final offset), stopped
    _hand_out(tmp_path, 0, [0, 1, 2, 3])
    _hand_out(tmp_path, 0, [4, 5, 6, 7])
    _train(tmp_path, 0, ["0", "1", "3"])          # 2 skipped: lost though not ended
    tally = ledger.count(str(tmp_path), {"0": 3}, ended=False)
    assert tally["lost"] == 1.0
    # after a seek back, only the last time the offset was handed out counts
    _hand_out(tmp_path, 0, [2, 3])
    _train(tmp_path, 0, ["2", "3"])
    assert ledger.count(str(tmp_path), {"0": 3}, ended=False)["lost"] == 0.0
    # a partition with no trained offset has nothing due yet
    _hand_out(tmp_path, 1, [100, 101])
    assert ledger.count(str(tmp_path), {"0": 3}, ended=False)["lost"] == 0.0
    assert ledger.count(str(tmp_path), {"0": 3}, ended=True)["lost"] == 6.0   # 4-7, 100-101


def test_redis_positions_and_records_without_an_id(tmp_path):
    ids = [ledger.record_id({"x": 1}, "3", p) for p in ("1700-0", "1700-1")]
    assert ids == ["3@1700-0", "3@1700-1"]
    assert ledger.record_id({"id": 7}, "3", "1700-2") == "7"
    _hand_out(tmp_path, 3, ["1700-0", "1700-1"], ids)
    _train(tmp_path, 0, ids[:1])
    assert ledger.count(str(tmp_path), {"3": "1700-1"}, ended=False)["lost"] == 1.0
    assert ledger.open_log(None, ledger.TRAINED, 0) is None
