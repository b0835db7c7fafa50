"""The GPU a rank uses, from Ray's assignment and CUDA_VISIBLE_DEVICES (no CUDA here:
the ids are plain strings, as ``ray.get_gpu_ids()`` gives them on a fake-GPU cluster)."""

from __future__ import annotations

import pytest

from dlrover_core.runtime.devices import actor_env, assign_device


def test_all_gpus_visible_uses_rays_id():
    a = assign_device([2], {})
    assert (a.gpu_ids, a.visible_devices, a.cuda_device, a.device) == (["2"], None, 2, "cuda:2")


def test_ray_set_visible_devices_gives_index_zero():
    a = assign_device(["3"], {"CUDA_VISIBLE_DEVICES": "3"})
    assert (a.visible_devices, a.cuda_device) == ("3", 0)


def test_node_level_visible_devices_map_ids_to_positions():
    # a raylet started with CUDA_VISIBLE_DEVICES=4,6: Ray's ids are 4 and 6
    assert assign_device(["6"], {"CUDA_VISIBLE_DEVICES": "4,6"}).cuda_device == 1


def test_no_gpu_is_cpu():
    a = assign_device([], {"CUDA_VISIBLE_DEVICES": ""})
    assert (a.cuda_device, a.device, a.as_dict()["gpu_ids"]) == (None, "cpu", [])


def test_invisible_assignment_is_refused():
    with pytest.raises(ValueError, match=r"Ray assigned GPU '1' but CUDA_VISIBLE_DEVICES='0'"):
        assign_device([1], {"CUDA_VISIBLE_DEVICES": "0"})


def test_actor_env():
    assert actor_env(1.0, False) == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert actor_env(1.0, True) == {} and actor_env(0.0, False) == {}
