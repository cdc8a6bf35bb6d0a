"""The GGUF tensors MLX's own reader gets wrong, read with llama.cpp's (``gguf``) instead.

* BF16: MLX's reader hands it over as float16 (a narrower range); its raw bits are kept instead.
* Q4_K (most of every Q4_K_M file): MLX's reader (gguflib) gives the high nibbles of every pair of sub-blocks the
  low ones' scale and min, and dequantizes to float16 besides. A Q4_K super-block is 8 sub-blocks of 32 weights,
  each ``w = d·sc·q − dmin·m`` with a 4-bit ``q``: exactly MLX's affine 4-bit quantization with groups of 32
  (scale ``d·sc``, bias ``−dmin·m``), so it is repacked into that layout and stays 4-bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["EXACT", "read_exactly"]

EXACT = frozenset({"BF16", "Q4_K"})  # the GGUF types this module reads
_Q4_K_BLOCK = 256  # weights in a super-block


def read_exactly(path: Path, names: set[str]) -> dict[str, Any]:
    """MLX arrays under MLX's reader's names (a Q4_K tensor's ``…weight``, ``…scales``, ``…biases``) for the
    tensors ``names`` of the file, each of a type in `EXACT`; one pass over the header, which is slow to parse."""
    if not names:
        return {}
    import gguf
    import mlx.core as mx
    import numpy as np

    arrays: dict[str, Any] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name not in names:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
            bits = np.ascontiguousarray(tensor.data).view(np.uint16)
            arrays[tensor.name] = mx.array(bits).view(mx.bfloat16).reshape(shape)
        elif tensor.tensor_type == gguf.GGMLQuantizationType.Q4_K:
            base = tensor.name.removesuffix(".weight")
            weight, scales, biases = q4_k_as_affine(np.asarray(tensor.data).reshape(-1, 144), shape)
            arrays |= {f"{base}.weight": weight, f"{base}.scales": scales, f"{base}.biases": biases}
        else:
            raise ValueError(f"{tensor.name} is {tensor.tensor_type.name}, not one of {sorted(EXACT)}")
    return arrays


def q4_k_as_affine(blocks: Any, shape: tuple[int, ...]) -> tuple[Any, Any, Any]:
    """Q4_K super-blocks (144 bytes each: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles) as MLX's
    4-bit affine layout with groups of 32: ``(weight uint32 [rows, cols/8], scales, biases float16 [rows, cols/32])``.

    In each 64 weights of a super-block, the first 32 are the low nibbles of 32 bytes and the next 32 their high
    nibbles; MLX packs 8 consecutive weights in a uint32, the first in the lowest bits.
    """
    import mlx.core as mx
    import numpy as np
    from gguf.quants import Q4_K

    n = len(blocks)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    with np.errstate(all="ignore"):  # a damaged block's inf and nan stay what they are
        scales = (d * sc.astype(np.float32)).astype(np.float16)  # (n, 8): one per sub-block of 32
        biases = (-(dmin * m.astype(np.float32))).astype(np.float16)
    nibbles = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    values = (nibbles & 0x0F).reshape(-1, 8).astype(np.uint32)  # weights in order, 8 to a word
    words = np.bitwise_or.reduce(values << (np.arange(8, dtype=np.uint32) * 4), axis=1)
    cols = shape[-1]
    return (
        mx.array(words.reshape(*shape[:-1], cols // 8)),
        mx.array(scales.reshape(*shape[:-1], cols // 32)),
        mx.array(biases.reshape(*shape[:-1], cols // 32)),
    )
