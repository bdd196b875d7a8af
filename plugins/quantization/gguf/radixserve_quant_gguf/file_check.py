"""A structural check of a .gguf file before anything loads it (`GGUFMethod.check_file`): header,
metadata and tensor infos walked without reading tensor data, so an empty, non-GGUF or truncated
file is one line naming it instead of a struct.error or reshape error from deep inside the reader."""

from __future__ import annotations

import os

_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def check_gguf_file(path: str) -> None:
    """Walk the GGUF header, metadata and tensor infos (no tensor data is read)."""
    import struct

    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path} is not a valid GGUF file (empty)")
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a valid GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
        try:
            _version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
            pos = 24

            def take(n: int) -> bytes:
                nonlocal pos
                if n < 0 or pos + n > size:
                    raise EOFError(f"needs {pos + n} bytes, the file has {size}")
                f.seek(pos)
                pos += n
                return f.read(n)

            def skip_string() -> None:
                nonlocal pos
                (n,) = struct.unpack("<Q", take(8))
                take(n)

            def skip_value(vtype: int) -> None:
                nonlocal pos
                if vtype in _GGUF_SCALARS:
                    take(_GGUF_SCALARS[vtype])
                elif vtype == _GGUF_STRING:
                    skip_string()
                elif vtype == _GGUF_ARRAY:
                    etype, count = struct.unpack("<IQ", take(12))
                    if etype in _GGUF_SCALARS:
                        take(_GGUF_SCALARS[etype] * count)
                    else:
                        for _ in range(count):
                            skip_value(etype)
                else:
                    raise ValueError(f"unknown metadata value type {vtype}")

            for _ in range(n_kv):
                skip_string()
                (vtype,) = struct.unpack("<I", take(4))
                skip_value(vtype)
            for _ in range(n_tensors):
                skip_string()
                (n_dims,) = struct.unpack("<I", take(4))
                take(8 * n_dims + 4)  # dims, ggml type
                (offset,) = struct.unpack("<Q", take(8))
                if pos + offset > size:  # the tensor data starts past the end (data follows the infos)
                    raise EOFError(f"tensor data at offset {offset} lies past the end ({size} bytes)")
        except (struct.error, EOFError) as e:
            raise ValueError(f"{path} is not a valid GGUF file (truncated: {e})") from None
        except ValueError as e:
            raise ValueError(f"{path} is not a valid GGUF file ({e})") from None
