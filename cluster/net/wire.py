"""What crosses the network: protocol version, package versions, tensors as bytes.

A tensor on the wire is `stage.proto` `Tensor{data, shape, dtype}`: raw little-endian
C-order bytes, the shape, and a dtype name. Nothing is trusted: `from_tensor` checks the
dtype, the exact shape and the byte count against what the receiver expects before it
touches the bytes, and names what was wrong (`WireError`).
"""

from __future__ import annotations

import re
import sys
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

# Bump on any incompatible change to stage.proto or to what a message means; peers with
# another protocol refuse each other by name. 5: image rows into stage 0 (Activation.media).
# 6: scored prefill chunks (Activation.score_targets: a last stage that ignored them would
# leave the head waiting for their answer, Event.scores).
# 7: hidden-state capture for block drafters (Activation.capture_layers / captured,
# Event.hidden: a last stage that ignored them would leave a capturing prefill unanswered).
PROTOCOL_VERSION = 7

# dtype name -> (MLX dtype, NumPy dtype of the bytes, bytes per element). bfloat16 travels
# as its uint16 bit pattern (NumPy has no bfloat16).
DTYPES = {
    "float32": (mx.float32, np.float32, 4),
    "bfloat16": (mx.bfloat16, np.uint16, 2),
    "float16": (mx.float16, np.float16, 2),
    "int32": (mx.int32, np.int32, 4),
}
ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")
SESSION_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class WireError(ValueError):
    """A message that does not match what the receiver expects (named field, got, want)."""


def dtype_name(dtype: mx.Dtype) -> str:
    """'float32' etc. for an MLX dtype; WireError for a dtype that cannot travel."""
    for name, (d, _, _) in DTYPES.items():
        if d == dtype:
            return name
    raise WireError(f"dtype {dtype} cannot be sent (allowed: {', '.join(DTYPES)})")


def mx_dtype(name: str) -> mx.Dtype:
    """MLX dtype for a wire dtype name; WireError for an unknown name."""
    if name not in DTYPES:
        raise WireError(f"unknown dtype {name!r} (allowed: {', '.join(DTYPES)})")
    return DTYPES[name][0]


def to_tensor(x: mx.array, dtype: Optional[str] = None, out=None):
    """An MLX array as a `stage_pb2.Tensor` (cast to `dtype` first when given).

    Evaluates `x`. The bytes are a copy in C order.
    """
    from kimi_mlx.cluster.net.stage_pb2 import Tensor

    if dtype is not None and dtype_name(x.dtype) != dtype:
        x = x.astype(mx_dtype(dtype))
    name = dtype_name(x.dtype)
    bits = x.view(mx.uint16) if name == "bfloat16" else x
    data = np.asarray(bits).tobytes()
    t = Tensor() if out is None else out
    t.data = data
    t.shape[:] = list(x.shape)
    t.dtype = name
    return t


def from_tensor(
    t, shape: Optional[Sequence[Optional[int]]], dtype: str, what: str = "tensor"
) -> mx.array:
    """Check a received `Tensor` and return it as an MLX array.

    Args:
        t: stage_pb2.Tensor.
        shape: the exact shape expected; None entries accept any size >= 1 in that
            dimension; None accepts any shape of at most 4 dimensions.
        dtype: the only dtype name accepted.
        what: name used in error messages.
    Raises:
        WireError: wrong dtype, shape or byte count (the message gives got and want).
    """
    if t.dtype != dtype:
        raise WireError(f"{what}: dtype {t.dtype or '(none)'}, expected {dtype}")
    got = tuple(int(s) for s in t.shape)
    if shape is None:
        if not 1 <= len(got) <= 4 or any(s < 1 for s in got):
            raise WireError(f"{what}: shape {list(got)} is not a valid array shape")
    elif len(got) != len(shape) or any(
        (w is None and g < 1) or (w is not None and g != w) for g, w in zip(got, shape)
    ):
        want = ["*" if w is None else w for w in shape]
        raise WireError(f"{what}: shape {list(got)}, expected {want}")
    _, np_dtype, size = DTYPES[dtype]
    count = 1
    for s in got:
        count *= s
    if len(t.data) != count * size:
        raise WireError(
            f"{what}: {len(t.data)} bytes, expected {count * size} for {dtype} {list(got)}"
        )
    arr = mx.array(np.frombuffer(t.data, dtype=np_dtype).reshape(got))
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr


def package_versions() -> Tuple[str, str]:
    """(kimi-mlx version, MLX version) of this install."""
    try:
        from importlib.metadata import version

        ours = version("kimi-mlx")
    except Exception:  # running from a source tree without metadata
        ours = "0+unknown"
    return ours, getattr(mx, "__version__", "unknown")


_BUILD: Optional[str] = None


def build_id() -> str:
    """12 hex characters hashing the installed kimi-mlx sources (kimi_mlx, its cluster
    and metal subpackages: *.py and *.metal). Same release, same id; an edited or
    different checkout gives another id, so numerics may differ (the head warns)."""
    global _BUILD
    if _BUILD is None:
        import hashlib
        from pathlib import Path

        import kimi_mlx

        roots = {Path(kimi_mlx.__file__).parent, Path(__file__).parent}
        try:
            import kimi_mlx.metal as metal

            roots.add(Path(metal.__file__).parent)
        except ImportError:
            pass
        h = hashlib.sha256()
        files = sorted({f for r in roots for pat in ("*.py", "*.metal") for f in r.rglob(pat)
                        if "__pycache__" not in f.parts})
        for f in files:
            try:
                h.update(f.name.encode() + b"\0" + f.read_bytes())
            except OSError:
                continue
        _BUILD = h.hexdigest()[:12]
    return _BUILD


def python_version() -> str:
    """'3.11' style version of this interpreter."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def check_session_id(session: str) -> None:
    """WireError unless `session` is 1-64 characters of [A-Za-z0-9_.:-]."""
    if not SESSION_RE.match(session or ""):
        raise WireError(f"session id {session[:80]!r} is not 1-64 characters of [A-Za-z0-9_.:-]")


def sampling_to_pb(sampling):
    """A `kimi_mlx.sampling.Sampling` as the `stage_pb2.Sampling` a last stage samples
    with: every field of both by the same name (the processors' fields, which run on the
    head, are not in the message); `seed` travels with `has_seed`. The one conversion to
    the wire (`sampling_from_pb` is its inverse)."""
    from dataclasses import fields

    from kimi_mlx.cluster.net.stage_pb2 import Sampling as PbSampling

    wire = PbSampling.DESCRIPTOR.fields_by_name
    values = {f.name: getattr(sampling, f.name) for f in fields(sampling)
              if f.name in wire and getattr(sampling, f.name) is not None}
    return PbSampling(**values, has_seed=sampling.seed is not None)


def sampling_from_pb(msg):
    """The `kimi_mlx.sampling.Sampling` of a `stage_pb2.Sampling`: each field the message
    sets (proto3: a non-zero scalar, or an `optional` one present) over the defaults, so a
    field an older head does not send keeps its default; `seed` only with `has_seed`.
    Ranges are checked (`Sampling.check`): InputError (a ValueError) names the field."""
    from dataclasses import fields

    from kimi_mlx.sampling import Sampling

    ours = {f.name for f in fields(Sampling)}
    values = {fd.name: v for fd, v in msg.ListFields() if fd.name in ours and fd.name != "seed"}
    if msg.has_seed:
        values["seed"] = msg.seed
    return Sampling(**values).check()
