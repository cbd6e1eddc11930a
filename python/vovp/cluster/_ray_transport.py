"""vovp as a Ray Direct Transport: ``@ray.method(tensor_transport="vovp")`` actor methods whose
CPU torch tensors travel through the nodes' vovp stores instead of Ray's object store.

Ray (2.60, its RDT API is alpha) keeps the tensors a method returns in the sender actor and
calls this transport at four points; what each does here:

- ``extract_tensor_transport_metadata`` (sender, when the method returns): every tensor is
  put into the sender's node store as an *ephemeral* object named ``ray-rdt-<object id>-<i>``
  (Ray's object id is unique, so are the names). The sender's client holds one reference to
  each (the store's copy ``put_tensor`` returns); Ray carries the names, dtypes, shapes and the
  sender's node to the receiver. A small result (``INLINE_BYTES`` in all) rides inside that
  metadata instead, as Ray's default inlines small results: a store round trip and a
  transfer would cost more than the bytes.
- ``recv_multiple_tensors`` (receiver; one-sided: the sender actor does nothing): on the
  sender's node, a zero-copy get from the node store. On another node, the object is first
  copied into the receiver's node store (``fetch_from_node``: vovp.cluster's engine-to-engine
  FETCH; the copy's name is deleted once got, so it goes with the received tensor), then
  got zero-copy. An object is visible only once sealed, and a sealed object is
  immutable: a receiver never sees a torn tensor.
- ``garbage_collect`` (sender, when Ray's reference counting frees the object): the held
  references are released; an ephemeral object vanishes with its last holder (a receiver
  still holding the tensor keeps it until it lets go).
- Sender death: its connection to the store closes and the store releases every reference a
  dead client held, so its ephemeral objects go with it, unseen by Ray. A receiver asking
  after that gets ``ObjectLost``, never a hang; so does one whose sender's node is gone.

Every wait on the way (the holder agent's answer, the engines' transfer) is bounded (the
engines drop a stream stalled for the cluster's ``stall_timeout``), which is why ``can_abort_transport`` is True: Ray need not kill actors to
unblock a transfer. Needs ``vovp.cluster.init`` (every node's store and agent) before use.
A receiving actor needs Ray's transfer thread: ``@ray.remote(enable_tensor_transport=True)``
or a ``tensor_transport`` method of its own (Ray 2.60; else a transfer queues behind the task
that waits for it until Ray's 60 s RDT timeout, whatever the transport: ray-project/ray#66264).

numpy arrays are not registered: Ray's RDT swaps the process-wide serializer of the transport's
data type, which for ``np.ndarray`` would send every other numpy array of the process through
pickle (``torch.from_numpy`` first is free).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional

import ray
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from .._lookup import version_of
from ..errors import InvalidArgument, ObjectLost, ObjectNotFound, TransferFailed, VovpError
from . import _api
from ._agent import agent_name
from ._directory import NAMESPACE

TRANSPORT_NAME = "vovp"
NAME_PREFIX = "ray-rdt-"
# A result of at most this many bytes (all its tensors together) travels inside the metadata
# Ray carries anyway, as Ray's default inlines small results: no store object, no transfer.
INLINE_BYTES = 64 << 10

_registered = False
_register_lock = threading.Lock()


def register_transport() -> None:
    """Register the "vovp" tensor transport with Ray (``@ray.method(tensor_transport="vovp")``
    for CPU torch tensors). Call it in the driver after ``vovp.cluster.init`` and before
    creating the actors that use it (Ray registers it on each actor from there). Idempotent."""
    global _registered
    import torch

    with _register_lock:
        if _registered:
            return
        ray.experimental.register_tensor_transport(
            TRANSPORT_NAME, ["cpu"], VovpTensorTransport, torch.Tensor)
        _registered = True


@dataclass
class VovpCommunicatorMetadata(CommunicatorMetadata):  # type: ignore[misc]
    """Nothing to agree on: the receiver reads by name from the holder's node."""


@dataclass
class VovpTransportMetadata(TensorTransportMetadata):  # type: ignore[misc]
    """What Ray carries from the sender to the receiver, besides shapes and dtypes."""

    names: List[str] = field(default_factory=list)  # the store objects, one per tensor
    node_id: Optional[str] = None  # the Ray node whose store holds them
    inline: Optional[List[bytes]] = None  # a small result's bytes, per tensor (then no names)


def object_names(obj_id: str, count: int) -> List[str]:
    return [f"{NAME_PREFIX}{obj_id}-{i}" for i in range(count)]


class VovpTensorTransport(TensorTransportManager):  # type: ignore[misc]
    """One per process (Ray makes it): the sender's held references, the receiver's aborts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[Any]] = {}  # obj_id -> the store copies this process holds
        self._aborted: set[str] = set()
        self._stall: Optional[float] = None

    def tensor_transport_backend(self) -> str:
        return TRANSPORT_NAME.upper()

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: "ray.actor.ActorHandle") -> bool:
        # Every node has a store and an agent once vovp.cluster is initialized; asking the
        # actor would block task submission (Ray calls this before submitting).
        return True

    # -- sender ------------------------------------------------------------------------------

    def extract_tensor_transport_metadata(self, obj_id: str,
                                          rdt_object: List[Any]) -> VovpTransportMetadata:
        meta = VovpTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
                                     tensor_device="cpu" if rdt_object else None,
                                     node_id=_api.node_id())
        if sum(t.numel() * t.element_size() for t in rdt_object) <= INLINE_BYTES:
            _check_cpu(rdt_object)
            meta.inline = [_raw(t) for t in rdt_object]  # a snapshot, as a put's
            return meta
        meta.names = object_names(obj_id, len(rdt_object))
        with self._lock:
            held = self._held.get(obj_id)
        if held is None:  # not a retry of a task whose result is stored already
            held = self._put(meta.names, rdt_object)
            with self._lock:
                self._held[obj_id] = held
        return meta

    @staticmethod
    def _put(names: List[str], tensors: List[Any]) -> list[Any]:
        """The tensors as ephemeral objects of this node's store, all or none; the store's
        copies (each holds this client's reference)."""
        _check_cpu(tensors)
        client = _api.client()
        copies: list[Any] = []
        try:
            for name, tensor in zip(names, tensors):
                copy = client.put_tensor(name, tensor.detach(), ephemeral=True)
                if tensor.numel():  # (an empty tensor views no store memory: no version)
                    version_of(copy)  # a pipelined put's refusal (a full store) is raised here
                copies.append(copy)
        except BaseException:
            for copy in copies:
                client.release(copy)
            raise
        return copies

    def send_multiple_tensors(self, tensors: List[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> None:
        raise NotImplementedError("the vovp transport is one-sided: the receiver reads")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: TensorTransportMetadata,
                        tensors: List[Any]) -> None:
        with self._lock:
            held = self._held.pop(obj_id, None)
        if held:
            client = _api.client()
            for copy in held:
                client.release(copy)

    def held_objects(self) -> int:
        """How many RDT objects this process holds in its node store (tests, debugging)."""
        with self._lock:
            return len(self._held)

    # -- receiver ----------------------------------------------------------------------------

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: Optional[str] = None) -> VovpCommunicatorMetadata:
        return VovpCommunicatorMetadata()

    def recv_multiple_tensors(self, obj_id: str,
                              tensor_transport_metadata: TensorTransportMetadata,
                              communicator_metadata: CommunicatorMetadata,
                              target_buffers: Optional[List[Any]] = None) -> List[Any]:
        meta = tensor_transport_metadata
        if not isinstance(meta, VovpTransportMetadata):
            raise InvalidArgument(f"not the vovp transport's metadata: {type(meta).__name__}")
        if meta.inline is not None:
            received = [_from_raw(raw, shape, dtype)
                        for raw, (shape, dtype) in zip(meta.inline, meta.tensor_meta)]
            return _into(target_buffers, received)
        local = meta.node_id == _api.node_id()
        received = []
        try:
            for name, (shape, dtype) in zip(meta.names, meta.tensor_meta):
                if self._is_aborted(obj_id):
                    raise VovpError(f"RDT object {obj_id}: transfer aborted by Ray")
                if local:
                    tensor = _get_local(name, meta.node_id)
                else:
                    tensor = fetch_from_node(str(meta.node_id), name, self._stall_timeout())
                if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                    raise VovpError(f"{name!r} is {tensor.dtype}{tuple(tensor.shape)}, Ray's "
                                    f"metadata says {dtype}{tuple(shape)}")
                received.append(tensor)
            if self._is_aborted(obj_id):
                raise VovpError(f"RDT object {obj_id}: transfer aborted by Ray")
        finally:
            with self._lock:
                self._aborted.discard(obj_id)
        return _into(target_buffers, received)

    def abort_transport(self, obj_id: str,
                        communicator_metadata: CommunicatorMetadata) -> None:
        """Stop receiving ``obj_id``: a transfer in progress ends at its next tensor (one
        tensor's stream is itself bounded by the stall timeout) and returns nothing."""
        with self._lock:
            self._aborted.add(obj_id)

    def _is_aborted(self, obj_id: str) -> bool:
        with self._lock:
            return obj_id in self._aborted

    def _stall_timeout(self) -> float:
        if self._stall is None:
            config = _api.call(_api.directory_actor().config.remote(), 60.0) or {}
            self._stall = float(config.get("stall_timeout", 30.0))
        return self._stall


def _check_cpu(tensors: List[Any]) -> None:
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise InvalidArgument(f"the vovp tensor transport takes CPU tensors, got one on "
                                  f"{tensor.device}")


def _raw(tensor: Any) -> bytes:
    """A CPU tensor's bytes (C order). Bytes, not the tensor: pickling a torch tensor costs
    ~20x as much, and Ray pickles the metadata twice on its way."""
    import torch

    raw: bytes = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return raw


def _from_raw(raw: bytes, shape: Any, dtype: Any) -> Any:
    import torch

    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _into(target_buffers: Optional[List[Any]], received: List[Any]) -> List[Any]:
    """``received``, or copied into the buffers Ray asked for (``set_target_for_ref``)."""
    if target_buffers is None:
        return received
    for buffer, tensor in zip(target_buffers, received):
        buffer.copy_(tensor)
    return list(target_buffers)


def _get_local(name: str, node: Optional[str]) -> Any:
    """``name`` from this node's store, zero-copy (a torch tensor holding a reference)."""
    try:
        return _api.client().get_tensor(name, framework="torch")
    except ObjectNotFound:
        raise ObjectLost(f"{name!r} is gone from the store of node {node}: its sender actor "
                         "died (the store freed what it held) or Ray freed the object", 0) \
            from None


def fetch_from_node(holder: str, name: str, stall_timeout: float) -> Any:
    """``name`` from the store of node ``holder``, copied into this node's store by this
    node's engine (vovp.cluster's engine-to-engine FETCH: concurrent receivers on this node
    share one transfer) and returned zero-copy from there; the copy's name is deleted at once,
    so its memory goes with the last tensor viewing it, as an ephemeral object's would.

    The one place the transport moves bytes between nodes. An RDT object's name is unique
    and put once: its version is 1.
    """
    client = _api.client()
    _holder_agent(holder)  # ObjectLost when the holder's node is gone
    address = _api.transfer_address(holder)
    try:
        tensor = client.fetch_from(address, name, 1, timeout=max(stall_timeout, 60.0),
                                   framework="torch")
    except TransferFailed as e:
        raise ObjectLost(f"{name!r}: the transfer from node {holder} failed ({e}); its sender "
                         "actor or node died (the store freed what it held), or it stalled",
                         0) from None
    try:
        client.delete(name)
    except ObjectNotFound:
        pass  # another receiver here deleted it first
    return tensor


def _holder_agent(holder: str) -> Any:
    try:
        return ray.get_actor(agent_name(holder), namespace=NAMESPACE)
    except ValueError:  # Ray knows no such actor: it died with its node
        raise ObjectLost(f"node {holder}, which holds the tensors, has no vovp agent: the "
                         "node is gone", 0) from None
