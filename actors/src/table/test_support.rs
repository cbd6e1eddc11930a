//! Helpers of the table's tests: device blocks as plain data (no allocator), and objects put
//! in one call.

use std::sync::Arc;

use vovp_types::{Device, DeviceBlock, HolderId, ObjectName, ObjectRef};

use super::{Freed, NewObject, ObjectTable};
use crate::block::Block;

pub(crate) const A: HolderId = HolderId::from_raw(1);
pub(crate) const B: HolderId = HolderId::from_raw(2);
/// The device of the blocks made by [`block`].
pub(crate) const GPU0: Device = Device::Cuda(0);

pub(crate) fn n(s: &str) -> ObjectName {
    ObjectName::new(s).unwrap()
}

/// A device block: plain data, so the table is tested without any allocator.
pub(crate) fn block(offset: u64, size: u64) -> Block {
    Block::Cuda(DeviceBlock {
        device: 0,
        pool: 0,
        ipc_handle: [0; 64],
        offset,
        size,
    })
}

/// A host block (a lent range: plain data too), for what only host objects do (spilling).
pub(crate) fn host_block(offset: u64, size: u64) -> Block {
    Block::Lent(crate::block::LentBlock {
        lend: 1,
        segment: 1,
        offset,
        charged: size.next_multiple_of(64),
    })
}

/// A sealed host object nobody holds (in the host LRU).
pub(crate) fn put_host(t: &mut ObjectTable, name: &str, size: u64) -> ObjectRef {
    let offset = t.len() as u64 * 4096;
    let r = t
        .insert(new_object(
            name,
            size,
            host_block(offset, size),
            false,
            false,
            A,
        ))
        .unwrap();
    assert!(t.seal(&n(name), A, Some(r.id)).unwrap().done.is_empty());
    assert!(t.release(r.id, A).unwrap().is_none());
    r
}

/// What `creator` inserts as `name` in `block` (metadata "m").
pub(crate) fn new_object(
    name: &str,
    size: u64,
    block: Block,
    ephemeral: bool,
    replace: bool,
    creator: HolderId,
) -> NewObject {
    NewObject {
        name: n(name),
        size,
        metadata: Arc::from(&b"m"[..]),
        block,
        ephemeral,
        replace,
        creator,
        version: None,
    }
}

/// An unsealed object of A's.
pub(crate) fn insert(t: &mut ObjectTable, name: &str, size: u64, ephemeral: bool) -> ObjectRef {
    let offset = t.len() as u64 * 4096;
    t.insert(new_object(
        name,
        size,
        block(offset, size),
        ephemeral,
        false,
        A,
    ))
    .unwrap()
}

/// A sealed object nobody holds (in the LRU).
pub(crate) fn put(t: &mut ObjectTable, name: &str, size: u64) -> ObjectRef {
    let r = insert(t, name, size, false);
    assert!(t.seal(&n(name), A, Some(r.id)).unwrap().done.is_empty());
    assert!(t.release(r.id, A).unwrap().is_none());
    r
}

/// A replacement of `name` by `by`, unsealed.
pub(crate) fn replace(
    t: &mut ObjectTable,
    name: &str,
    size: u64,
    by: HolderId,
) -> Result<ObjectRef, vovp_types::Error> {
    let offset = (t.len() as u64 + 64) * 4096;
    t.insert(new_object(name, size, block(offset, size), false, true, by))
}

pub(crate) fn ok(t: &ObjectTable) {
    t.check_invariants().unwrap();
}

pub(crate) fn refcount(t: &ObjectTable, name: &str) -> u32 {
    t.list()
        .into_iter()
        .find(|i| i.name.as_str() == name)
        .map(|i| i.refcount)
        .unwrap()
}

pub(crate) fn names(freed: &[Freed]) -> Vec<&str> {
    freed.iter().map(|f| f.name.as_str()).collect()
}
