"""DataType and ParallelType, named as in nvFuser's Python frontend."""

from __future__ import annotations

import enum

import torch

from tp_fusion.errors import DefinitionError


class DataType(enum.Enum):
    """A tensor's element type, with nvFuser's names: ``define_tensor([n], dtype=DataType.BFloat16)``.

    ``dt.torch`` is the torch dtype, ``DataType.from_torch(torch.bfloat16)`` the reverse, and
    ``dt.short`` the name plans print (``bf16``). ``Null`` means "no dtype" (as None does).
    """

    Float = "float32"
    Double = "float64"
    Half = "float16"
    BFloat16 = "bfloat16"
    Int = "int64"
    Int32 = "int32"
    UInt64 = "uint64"  # philox seeds and offsets of sdpfa_fwd/bwd, as in nvFuser
    Bool = "bool"
    ComplexFloat = "complex64"
    ComplexDouble = "complex128"
    Null = "null"  # nvFuser's "no dtype" (e.g. ``sum(..., dtype=DataType.Null)``): the same as None

    def __repr__(self) -> str:
        return f"DataType.{self.name}"

    def __call__(self) -> DataType:
        """The DataType itself: nvFuser's ``tv.dtype()`` is a method, tp_fusion's ``tv.dtype`` a property,
        and both spellings give the same DataType."""
        return self

    @property
    def torch(self) -> torch.dtype:
        """The torch dtype (``DataType.Float.torch is torch.float32``)."""
        if self is DataType.Null:
            raise DefinitionError("DataType.Null is no tensor dtype (nvFuser's 'no dtype'); pass a concrete DataType")
        return getattr(torch, self.value)

    @property
    def short(self) -> str:
        """The short name used in printed fusions and plans: ``f32``, ``bf16``, ``i64``, ..."""
        return _SHORT[self]

    @property
    def is_floating(self) -> bool:
        """Whether it is a floating-point type."""
        return self in (DataType.Float, DataType.Double, DataType.Half, DataType.BFloat16)

    @property
    def is_complex(self) -> bool:
        """Whether it is a complex type (``ComplexFloat``: two float32, ``ComplexDouble``: two float64)."""
        return self in (DataType.ComplexFloat, DataType.ComplexDouble)

    @property
    def python_type(self) -> type:
        """The Python type of a number of this dtype: ``bool``, ``int``, ``float`` or ``complex``."""
        if self is DataType.Bool:
            return bool
        return complex if self.is_complex else float if self.is_floating else int

    @staticmethod
    def of_number(value) -> DataType:
        """The dtype of a Python number as nvFuser's scalars take it (as Python computes): a bool is Bool, an int
        Int, a float Double and a complex ComplexDouble."""
        return {bool: DataType.Bool, int: DataType.Int, float: DataType.Double,
                complex: DataType.ComplexDouble}[type(value)]

    @staticmethod
    def from_torch(dtype: torch.dtype) -> DataType:
        """The DataType of a torch dtype; a DefinitionError (a ValueError) if there is none."""
        for dt in DataType:
            if dt is not DataType.Null and dt.torch == dtype:
                return dt
        raise DefinitionError(f"torch dtype {dtype} has no tp_fusion DataType; the DataTypes are "
                              f"{', '.join(dt.name for dt in DataType if dt is not DataType.Null)}")


_SHORT = {
    DataType.Float: "f32", DataType.Double: "f64", DataType.Half: "f16", DataType.BFloat16: "bf16",
    DataType.Int: "i64", DataType.Int32: "i32", DataType.UInt64: "u64", DataType.Bool: "bool",
    DataType.ComplexFloat: "c64", DataType.ComplexDouble: "c128", DataType.Null: "null",
}


class ParallelType(enum.Enum):
    """How a loop axis is executed. ``mesh_x`` binds to the LAST mesh axis, ``mesh_y`` the one before."""

    serial = "serial"
    mesh_x = "mesh_x"
    mesh_y = "mesh_y"
    mesh_z = "mesh_z"

    # nvFuser's names for the device dims.
    DIDx = "mesh_x"
    DIDy = "mesh_y"
    DIDz = "mesh_z"
    # nvFuser's stream-parallel loop runs its iterations on CUDA streams: a schedule, not a change of
    # values. tp_fusion runs it as a serial loop and overlaps communication in its fused segments.
    stream = "serial"

    @property
    def is_device(self) -> bool:
        """Whether it binds an axis to a device dim (anything but ``serial``)."""
        return self is not ParallelType.serial

    def mesh_axis(self, mesh_ndim: int) -> int:
        """The mesh axis this type binds to on a mesh of ``mesh_ndim`` axes (-1 if beyond it)."""
        return mesh_ndim - 1 - _DEVICE_ORDER.index(self)

    @staticmethod
    def for_mesh_axis(axis: int, mesh_ndim: int) -> ParallelType:
        """The device type bound to mesh axis ``axis`` of a mesh of ``mesh_ndim`` axes."""
        return _DEVICE_ORDER[mesh_ndim - 1 - axis]


_DEVICE_ORDER = (ParallelType.mesh_x, ParallelType.mesh_y, ParallelType.mesh_z)
