//! The one API of a store, embedded or remote: [`Store`] (blocking) and [`AsyncStore`]. A framework
//! written against these switches between `Engine::spawn` and a socket client in one line.
//! (CUDA tensors: `vovp_gpu::CudaStore`, implemented for every `Store`.)

use std::future::Future;
use std::time::Duration;

use crate::tensor::{Tensor, TensorView};
use crate::{CreateOptions, Error, ObjectBuffer, ObjectInfo, ObjectView, StoreStats};

/// Blocking store API. `timeout`: `None` answers at once; `Some(d)` waits up to `d` for objects
/// that are not sealed yet.
pub trait Store: Send + Sync {
    /// Creates an unsealed object of `size` bytes; write it, then seal.
    fn create(
        &self,
        name: &str,
        size: u64,
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<ObjectBuffer, Error>;
    /// Seals `name` (created by this caller): the name's version it became.
    fn seal(&self, name: &str) -> Result<u64, Error>;
    fn abort(&self, name: &str) -> Result<(), Error>;
    /// Creates, copies (in parallel above 1 MB) and seals in one call; keeps no reference.
    fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<(), Error>;
    /// One entry per name, in order: `None` when not sealed within the timeout.
    fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error>;
    /// `name` as a version newer than `newer_than`, waiting up to `timeout` for one to be
    /// sealed ([`Error::NotFound`] when none is); `newer_than` 0 is any version, as
    /// [`Store::get_one`].
    fn get_newer(
        &self,
        name: &str,
        newer_than: u64,
        timeout: Option<Duration>,
    ) -> Result<ObjectView, Error>;
    fn contains(&self, name: &str) -> Result<bool, Error>;
    fn delete(&self, name: &str) -> Result<(), Error>;
    fn list(&self) -> Result<Vec<ObjectInfo>, Error>;
    fn evict(&self, bytes: u64) -> Result<u64, Error>;
    fn stats(&self) -> Result<StoreStats, Error>;

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

/// The same API for async code.
pub trait AsyncStore: Send + Sync {
    fn create(
        &self,
        name: &str,
        size: u64,
        metadata: &[u8],
        options: CreateOptions,
    ) -> impl Future<Output = Result<ObjectBuffer, Error>> + Send;
    fn seal(&self, name: &str) -> impl Future<Output = Result<u64, Error>> + Send;
    fn abort(&self, name: &str) -> impl Future<Output = Result<(), Error>> + Send;
    fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<Vec<Option<ObjectView>>, Error>> + Send;
    /// See [`Store::get_newer`].
    fn get_newer(
        &self,
        name: &str,
        newer_than: u64,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<ObjectView, Error>> + Send;
    fn contains(&self, name: &str) -> impl Future<Output = Result<bool, Error>> + Send;
    fn delete(&self, name: &str) -> impl Future<Output = Result<(), Error>> + Send;
    fn list(&self) -> impl Future<Output = Result<Vec<ObjectInfo>, Error>> + Send;
    fn evict(&self, bytes: u64) -> impl Future<Output = Result<u64, Error>> + Send;
    fn stats(&self) -> impl Future<Output = Result<StoreStats, Error>> + Send;
}
