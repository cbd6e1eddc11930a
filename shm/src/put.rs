//! The embedded engine's put of an object that does not ride in one message
//! ([`vovp_types::Route::CreateCopySeal`]): create it, copy the bytes into the mapping (split
//! across the rayon pool above 1 MB), seal. (The clients' is `vovp-client`'s `ops`, over their
//! connection.)

use vovp_types::{AsyncStore, CreateOptions, Error};

use crate::copy::parallel_copy;

/// Creates `name`, copies `data` in and seals it: the seal goes through `store` (a buffer's
/// own seal blocks), and the creator's reference is released once the seal is acknowledged.
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
