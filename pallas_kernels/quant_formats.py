"""The quantized weight layouts the matmul kernels and ``models.quant`` share (one definition
for the C++ kernels' wrappers, the Pallas block-dequantizing matmul and the quantizer)."""

from __future__ import annotations

import numpy as np

#: inputs per block of the "q4" layout (GGUF Q4_0 / Q4_1's block; Q4_K's sub-block): one scale
#: and one offset each
Q4_BLOCK = 32
#: dtypes a quantized layer's scales (and "q4"'s offsets) may have; the C++ kernels read both
#: as stored
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
