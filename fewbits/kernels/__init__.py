"""Fast paths for quantised matmuls behind one dispatcher, and the reference path they are tested against."""

from fewbits.kernels.dispatch import CANDIDATES, choose_kernel, linear, prepare_linear
from fewbits.kernels.reference import ReferenceKernel, reference_linear

__all__ = ["CANDIDATES", "ReferenceKernel", "choose_kernel", "linear", "prepare_linear", "reference_linear"]
