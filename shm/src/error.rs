/// What can go wrong building, mapping or using a directory or a hold table.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    #[error("the directory is full: all {capacity} entries are live")]
    DirectoryFull { capacity: usize },
    #[error("the hold table is full: all {slots} slots hold an object")]
    HoldTableFull { slots: usize },
    #[error("a name must not be empty")]
    EmptyName,
    #[error("name is {len} bytes long; a directory entry holds at most {max}")]
    NameTooLong { len: usize, max: usize },
    #[error("the name is already published (entry {index})")]
    AlreadyPublished { index: usize },
    #[error("entry {index} does not hold a live object of generation {generation}")]
    NotLive { index: usize, generation: u64 },
    #[error("hold slot {slot} does not hold generation {generation}")]
    NotHeld { slot: usize, generation: u64 },
    #[error("bad magic: expected {expected:#018x}, found {found:#018x} (not a vovp {what})")]
    BadMagic {
        what: &'static str,
        expected: u64,
        found: u64,
    },
    #[error("layout version {found} not supported by this build (which speaks {expected})")]
    VersionMismatch { expected: u32, found: u32 },
    #[error("layout mismatch: {what} is {found}, this build expects {expected}")]
    LayoutMismatch {
        what: &'static str,
        expected: u64,
        found: u64,
    },
    #[error("region too small: {len} bytes, its header asks for {needed}")]
    RegionTooSmall { len: u64, needed: u64 },
    #[error("bad capacity {requested}: must be a power of two between 1 and {max}")]
    BadCapacity { requested: usize, max: usize },
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = ShmError> = std::result::Result<T, E>;
