//! Opcodes and reply status codes: each written once, with its PROTOCOL.md name.

/// Declares a `u8` code enum with its wire value, its PROTOCOL.md name and the list of all.
macro_rules! codes {
    ($(#[$doc:meta])* $ty:ident { $($(#[$vdoc:meta])* $var:ident = $code:literal, $name:literal;)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum $ty {
            $($(#[$vdoc])* $var = $code,)*
        }

        impl $ty {
            /// Every code, in wire order.
            pub const ALL: &'static [$ty] = &[$($ty::$var),*];

            /// The code of a wire byte; `None` for a byte this protocol version does not know.
            pub fn from_code(code: u8) -> Option<$ty> {
                match code {
                    $($code => Some($ty::$var),)*
                    _ => None,
                }
            }

            pub fn code(self) -> u8 {
                self as u8
            }

            /// The name PROTOCOL.md gives it.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$var => $name,)*
                }
            }
        }
    };
}

codes! {
    /// A request's opcode (a reply carries it with [`crate::REPLY_BIT`] set).
    Opcode {
        Hello = 0x01, "HELLO";
        Create = 0x02, "CREATE";
        Seal = 0x03, "SEAL";
        Abort = 0x04, "ABORT";
        Put = 0x05, "PUT";
        Get = 0x06, "GET";
        Release = 0x07, "RELEASE";
        Contains = 0x08, "CONTAINS";
        Delete = 0x09, "DELETE";
        List = 0x0A, "LIST";
        Evict = 0x0B, "EVICT";
        Stats = 0x0C, "STATS";
        Subscribe = 0x0D, "SUBSCRIBE";
        /// Server to client only (request id 0): never a request, never replied to.
        Notify = 0x0E, "NOTIFY";
        Segment = 0x0F, "SEGMENT";
        Shared = 0x10, "SHARED";
        Lend = 0x11, "LEND";
        Publish = 0x12, "PUBLISH";
        GetNewer = 0x13, "GET_NEWER";
        PublishMany = 0x14, "PUBLISH_MANY";
        Metrics = 0x15, "METRICS";
        TransferInfo = 0x16, "TRANSFER_INFO";
        Fetch = 0x17, "FETCH";
        Gather = 0x18, "GATHER";
    }
}

impl Opcode {
    /// Whether a client may send it (every opcode but NOTIFY).
    pub fn is_request(self) -> bool {
        self != Opcode::Notify
    }
}

codes! {
    /// The status of an error reply (0, OK, is not an error and has no variant: a reply's
    /// status byte is 0 or one of these).
    Status {
        NotFound = 1, "NOT_FOUND";
        AlreadyExists = 2, "ALREADY_EXISTS";
        /// With fields after its message: `u64 requested, u64 available`.
        OutOfMemory = 3, "OUT_OF_MEMORY";
        NotSealed = 4, "NOT_SEALED";
        AlreadySealed = 5, "ALREADY_SEALED";
        NotCreator = 6, "NOT_CREATOR";
        InvalidName = 7, "INVALID_NAME";
        MetadataTooLarge = 8, "METADATA_TOO_LARGE";
        NotHeld = 9, "NOT_HELD";
        GpuUnavailable = 10, "GPU_UNAVAILABLE";
        GpuError = 11, "GPU_ERROR";
        Malformed = 12, "MALFORMED";
        UnsupportedVersion = 13, "UNSUPPORTED_VERSION";
        UnknownOpcode = 14, "UNKNOWN_OPCODE";
        TooLarge = 15, "TOO_LARGE";
        ShuttingDown = 16, "SHUTTING_DOWN";
        Internal = 17, "INTERNAL";
        ProtocolState = 18, "PROTOCOL_STATE";
        TooManyObjects = 19, "TOO_MANY_OBJECTS";
        TooManyConnections = 20, "TOO_MANY_CONNECTIONS";
        /// A spilled object's file was damaged, truncated or removed: the object is gone.
        SpillDamaged = 21, "SPILL_DAMAGED";
        /// With fields after its message: `u64 current, u64 requested`.
        StaleVersion = 22, "STALE_VERSION";
        /// A transfer between engines failed (FETCH, GATHER): the message says where.
        TransferFailed = 23, "TRANSFER_FAILED";
    }
}

impl Status {
    /// Whether its error reply carries two `u64` figures after the message: OUT_OF_MEMORY's
    /// `requested, available` and STALE_VERSION's `current, requested`.
    pub fn has_figures(self) -> bool {
        matches!(self, Status::OutOfMemory | Status::StaleVersion)
    }
}

/// The status byte of a successful reply.
pub const STATUS_OK: u8 = 0;
