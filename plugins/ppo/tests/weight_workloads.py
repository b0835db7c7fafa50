"""Workloads for the weight-sync tests (imported by the Ray workers as
``plugins.ppo.tests.weight_workloads``)."""

from __future__ import annotations

from dlrover_plugin_ppo.toy import ToyActor, ToyRollout
from dlrover_plugin_ppo.workloads import cpu_state_dict, unwrap


class SharingActor(ToyActor):
    """Stands in for an actor whose policy is on a GPU: CUDA IPC handles need a GPU, so
    ``share_weights`` sends a CPU state dict in their place."""

    def share_weights(self):
        return cpu_state_dict(self.policy)


class HalfSharedRollout(ToyRollout):
    """Rank 0 loads what ``share_weights`` sent (as a rank on the actor's GPU maps the
    handles); every other rank answers ``None``, as a rank on another GPU does."""

    def set_weights_shared(self, shared):
        if shared is None or self.rank != 0:
            return None
        out = self.set_weights(shared)
        self.weights_transport = "cuda_ipc"
        return out

    def transport(self):
        return self.weights_transport


class CudaActor(ToyActor):
    """The toy policy on the GPU Ray gave this actor (gpu-marked tests only)."""

    def setup(self) -> None:
        super().setup()
        self.policy.to("cuda")

    def digest(self) -> list:
        return unwrap(self.policy).state_dict()["logits"].cpu().tolist()


class CudaRollout(ToyRollout):
    """The toy rollout on the GPU Ray gave it (gpu-marked tests only)."""

    def setup(self) -> None:
        super().setup()
        self.policy.to("cuda")

    def transport(self):
        return self.weights_transport

    def digest(self) -> list:
        state = unwrap(self.policy).state_dict()["logits"]
        assert state.device.type == "cuda"
        return state.cpu().tolist()


