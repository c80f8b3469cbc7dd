# Ported from NVIDIA/Fuser tests/python/multidevice/__init__.py
# (https://github.com/NVIDIA/Fuser, commit 81c4b22fd750d377d69e24928c32233162f6b2bd),
# BSD-3-Clause; the upstream copyright notice follows. Changed lines are marked `# tp_fusion:` and
# listed in docs/nvfuser.md.
# SPDX-FileCopyrightText: Copyright (c) 2025-present NVIDIA CORPORATION & AFFILIATES.
# All rights reserved.
# SPDX-License-Identifier: BSD-3-Clause

from enum import auto, Enum


class Parallelism(Enum):
    # https://docs.nvidia.com/nemo-framework/user-guide/latest/nemotoolkit/features/parallelisms.html#tensor-parallelism
    TENSOR_PARALLEL = auto()
    # https://docs.nvidia.com/nemo-framework/user-guide/latest/nemotoolkit/features/parallelisms.html#sequence-parallelism
    SEQUENCE_PARALLEL = auto()
