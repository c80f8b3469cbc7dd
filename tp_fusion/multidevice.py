"""nvFuser's ``multidevice`` namespace (``nvfuser_direct.multidevice``), for ports of nvFuser's tests:
``nvfuser.multidevice.DeviceMesh(torch.arange(d))`` and ``nvfuser.multidevice.shard_tensor(t, tv)``."""

from tp_fusion import DeviceMesh, shard_tensor

__all__ = ["DeviceMesh", "shard_tensor"]
