"""vovp: a shared-memory tensor store (client for the ``vovp-engine`` daemon).

    import vovp, numpy as np
    client = vovp.init_client("/tmp/vovp.sock")
    a = client.put_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    b = vovp.init_client("/tmp/vovp.sock").get_tensor("x")   # same memory, any process

See README.md for lifetimes, dtypes and multiprocessing support (``init_reduction``).
"""

from .client import DEFAULT_SOCKET, Client, Subscription, init_client
from .cuda import CudaTensor
from .errors import (
    AlreadySealed,
    ConnectionError,
    GpuError,
    GpuUnavailable,
    InternalError,
    InvalidName,
    MetadataTooLarge,
    NotCreator,
    NotHeld,
    NotSealed,
    ObjectExists,
    ObjectNotFound,
    OutOfMemory,
    ProtocolError,
    ShuttingDown,
    TooLarge,
    VovpError,
)
from .reduction import default_client, init_reduction, worker_init_fn
from .tensor import TensorMeta, decode_header, encode_header

__version__ = "0.1.0"

__all__ = [
    "CudaTensor",
    "Client",
    "Subscription",
    "init_client",
    "init_reduction",
    "worker_init_fn",
    "default_client",
    "DEFAULT_SOCKET",
    "TensorMeta",
    "encode_header",
    "decode_header",
    "VovpError",
    "ObjectNotFound",
    "ObjectExists",
    "OutOfMemory",
    "NotSealed",
    "AlreadySealed",
    "NotCreator",
    "InvalidName",
    "MetadataTooLarge",
    "NotHeld",
    "GpuUnavailable",
    "GpuError",
    "ProtocolError",
    "TooLarge",
    "ShuttingDown",
    "InternalError",
    "ConnectionError",
]
