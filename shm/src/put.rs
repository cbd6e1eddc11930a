//! The put of an object that does not ride in one message, the same for the embedded engine
//! and both Rust clients: create it, copy the bytes into the mapping (split across the rayon
//! pool above 1 MB), seal. What differs between them (whether small objects go inline, through
//! a lend, or pipelined) is decided before this and stays with each.

use vovp_types::{AsyncStore, CreateOptions, Error, ObjectView, Store};

use crate::copy::parallel_copy;

/// Creates `name`, copies `data` in and seals it; the caller keeps the returned reference.
pub fn create_copy_seal<S: Store + ?Sized>(
    store: &S,
    name: &str,
    data: &[u8],
    metadata: &[u8],
    options: CreateOptions,
) -> Result<ObjectView, Error> {
    let mut buf = store.create(name, data.len() as u64, metadata, options)?;
    parallel_copy(buf.as_mut_slice(), data);
    buf.seal()
}

/// The same for async code: the seal goes through `store` (a buffer's own seal blocks), and the
/// creator's reference is released once the seal is acknowledged.
pub async fn create_copy_seal_async<S: AsyncStore + ?Sized>(
    store: &S,
    name: &str,
    data: &[u8],
    metadata: &[u8],
    options: CreateOptions,
) -> Result<(), Error> {
    let mut buf = store
        .create(name, data.len() as u64, metadata, options)
        .await?;
    parallel_copy(buf.as_mut_slice(), data);
    store.seal(name).await?;
    drop(buf.into_view());
    Ok(())
}
