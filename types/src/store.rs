//! The one API of a store, embedded or remote: [`Store`] (blocking) and [`AsyncStore`]. A framework
//! written against these switches between `Engine::spawn` and a socket client in one line.
//! (CUDA tensors: `vovp_gpu::CudaStore`, implemented for every `Store`.)

use std::future::Future;
use std::time::Duration;

use crate::tensor::{Tensor, TensorView};
use crate::{CreateOptions, Error, ObjectBuffer, ObjectInfo, ObjectView, StoreStats};

/// Defines [`Store`] and [`AsyncStore`] from one list of operations, so that the blocking and
/// the async API cannot drift apart: each `fn` of the list is a method of both (`Result<T,
/// Error>` in `Store`, a `Send` future of it in `AsyncStore`), with its documentation; the
/// items after the list are `Store`'s provided methods.
macro_rules! store_traits {
    (
        $(
            $(#[$doc:meta])*
            fn $name:ident($($arg:ident: $ty:ty),*) -> $out:ty;
        )*
        provided: { $($provided:item)* }
    ) => {
        /// Blocking store API. `timeout`: `None` answers at once; `Some(d)` waits up to `d` for
        /// objects that are not sealed yet.
        pub trait Store: Send + Sync {
            $(
                $(#[$doc])*
                fn $name(&self, $($arg: $ty),*) -> Result<$out, Error>;
            )*
            $($provided)*
        }

        /// The same API for async code (see [`Store`]).
        pub trait AsyncStore: Send + Sync {
            $(
                $(#[$doc])*
                fn $name(&self, $($arg: $ty),*) -> impl Future<Output = Result<$out, Error>> + Send;
            )*
        }
    };
}

store_traits! {
    /// Creates an unsealed object of `size` bytes; write it, then seal.
    fn create(name: &str, size: u64, metadata: &[u8], options: CreateOptions) -> ObjectBuffer;
    /// Seals `name` (created by this caller): the name's version it became.
    fn seal(name: &str) -> u64;
    fn abort(name: &str) -> ();
    /// Creates, copies (in parallel above 1 MB) and seals in one call; keeps no reference.
    fn put(name: &str, data: &[u8], metadata: &[u8], options: CreateOptions) -> ();
    /// One entry per name, in order: `None` when not sealed within the timeout.
    fn get(names: &[&str], timeout: Option<Duration>) -> Vec<Option<ObjectView>>;
    /// `name` as a version newer than `newer_than`, waiting up to `timeout` for one to be
    /// sealed ([`Error::NotFound`] when none is); `newer_than` 0 is any version, as
    /// [`Store::get_one`].
    fn get_newer(name: &str, newer_than: u64, timeout: Option<Duration>) -> ObjectView;
    fn contains(name: &str) -> bool;
    fn delete(name: &str) -> ();
    fn list() -> Vec<ObjectInfo>;
    fn evict(bytes: u64) -> u64;
    fn stats() -> StoreStats;

    provided: {
        /// One object; [`Error::NotFound`] when it is not sealed within the timeout.
        fn get_one(&self, name: &str, timeout: Option<Duration>) -> Result<ObjectView, Error> {
            self.get(&[name], timeout)?
                .pop()
                .flatten()
                .ok_or_else(|| Error::NotFound(name.to_string()))
        }

        /// Stores a host tensor with its dtype and shape, so a get needs only the name.
        fn put_tensor(&self, name: &str, tensor: &TensorView<'_>) -> Result<(), Error> {
            self.put(
                name,
                tensor.data,
                &tensor.meta().encode(),
                CreateOptions::default(),
            )
        }

        /// A tensor by name alone: zero-copy, released on drop.
        fn get_tensor(&self, name: &str, timeout: Option<Duration>) -> Result<Tensor, Error> {
            Tensor::from_view(self.get_one(name, timeout)?)
        }
    }
}
