"""vovp: a shared-memory tensor store (client for the ``vovp-engine`` daemon).

    import vovp, torch
    client = vovp.init_client("/tmp/vovp.sock")
    a = client.put_tensor("x", torch.arange(6.0).reshape(2, 3))
    b = vovp.init_client("/tmp/vovp.sock").get_tensor("x")   # a torch tensor, same memory

numpy arrays work the same way. See README.md for lifetimes, dtypes, batch calls
(``get_tensors``/``put_tensors``) and multiprocessing / DataLoader support
(``init_reduction``, ``worker_init_fn``).
"""

from .client import DEFAULT_SOCKET, Client, Subscription, init_client, version_of
from .cuda import CudaTensor
from .daemon import StoreProcess, start_store
from . import errors
from .errors import *  # noqa: F403 (every exception class, listed once: vovp.errors.__all__)
from .reduction import default_client, init_reduction, worker_init_fn
from .tensor import TensorMeta, decode_header, encode_header

__version__ = "0.1.0"

__all__ = [
    "CudaTensor",
    "Client",
    "Subscription",
    "init_client",
    "version_of",
    "start_store",
    "StoreProcess",
    "init_reduction",
    "worker_init_fn",
    "default_client",
    "DEFAULT_SOCKET",
    "TensorMeta",
    "encode_header",
    "decode_header",
]
__all__ += errors.__all__
