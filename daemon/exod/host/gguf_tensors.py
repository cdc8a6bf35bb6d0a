"""The GGUF tensors MLX's own reader gets wrong, read with llama.cpp's (``gguf``) instead.

* BF16: MLX's reader hands it over as float16 (a narrower range); its raw bits are kept instead.
* Q4_K (most of every Q4_K_M file): MLX's reader (gguflib) gives the high nibbles of every pair of sub-blocks the
  low ones' scale and min, and dequantizes to float16 besides. A Q4_K super-block is 8 sub-blocks of 32 weights,
  each ``w = d·sc·q − dmin·m`` with a 4-bit ``q``: exactly MLX's affine 4-bit quantization with groups of 32
  (scale ``d·sc``, bias ``−dmin·m``), so it is repacked into that layout and stays 4-bit.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXACT", "ExactReader", "q4_k_as_affine"]

EXACT = frozenset({"BF16", "Q4_K"})  # the GGUF types this module reads
_Q4_K_BLOCK = 256  # weights in a super-block


class ExactReader:
    """A file's tensors of the types in `EXACT`, each read when asked, from the file's `gguf.GGUFReader`."""

    def __init__(self, reader: Any) -> None:
        self._tensors = {t.name: t for t in reader.tensors if t.tensor_type.name in EXACT}

    def read(self, name: str) -> dict[str, Any]:
        """The tensor ``name`` as MLX arrays under MLX's reader's names (a Q4_K one's ``…weight``, ``…scales``,
        ``…biases``)."""
        import mlx.core as mx
        import numpy as np

        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tensor.tensor_type.name == "BF16":
            bits = np.ascontiguousarray(tensor.data).view(np.uint16)
            return {name: mx.array(bits).view(mx.bfloat16).reshape(shape)}
        base = name.removesuffix(".weight")
        weight, scales, biases = q4_k_as_affine(np.asarray(tensor.data).reshape(-1, 144), shape)
        return {f"{base}.weight": weight, f"{base}.scales": scales, f"{base}.biases": biases}


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
    pairs = (nibbles & 0x0F).reshape(-1, 2)  # the weights in order, two by two
    words = (pairs[:, 0] | (pairs[:, 1] << 4)).view("<u4")  # a little-endian word holds 8, the first lowest
    cols = shape[-1]
    return (
        mx.array(words.reshape(*shape[:-1], cols // 8)),
        mx.array(scales.reshape(*shape[:-1], cols // 32)),
        mx.array(biases.reshape(*shape[:-1], cols // 32)),
    )
