//! Gets without a message: the store's shared directory (mapped read-only) and this
//! connection's hold table ([`vovp_shm::SharedReader`]), read through [`vovp_shm::held`] (the
//! embedded engine's code too). Anything that path cannot serve goes over the socket, with the
//! same semantics.

use std::fs::File;
use std::os::fd::OwnedFd;

use vovp_shm::SharedReader;
use vovp_types::Error;

/// Maps the two fds of a SHARED reply (directory first, then the hold table).
pub(crate) fn map(fds: Vec<OwnedFd>) -> Result<SharedReader, Error> {
    let [directory, holds]: [OwnedFd; 2] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
        Error::Protocol(format!("SHARED reply carried {} fds, not 2", fds.len()))
    })?;
    SharedReader::open(&File::from(directory), &File::from(holds))
        .map_err(|e| Error::Memory(format!("shared directory: {e}")))
}
